"""Expert parallelism for transformers mixture-of-experts models.

Each MoE layer's fused expert stacks (``gate_up_proj``, ``down_proj``, their biases: one
row per expert) are split by expert over the ranks of an expert-parallel group, and each
token goes to the ranks that hold its chosen experts and comes back. annot writes none of
this: the split and the token exchange are transformers' own expert-parallel styles,
applied from the model's own ``ep_plan`` (its config's ``base_model_ep_plan``):
``grouped_gemm`` makes each stack a DTensor sharded on dim 0 over the group and sets the
module's ``num_experts`` to its local count; ``ep_dispatch_experts`` replaces the experts
module's forward with transformers' ``AllToAllEP`` (sort the (token, expert) pairs by
expert, one all-to-all out, the local experts, one all-to-all back, weights applied by
the sender), whose backward is autograd's. The router, shared experts and attention stay
dense; the load-balancing loss is computed from the router logits before dispatch, as
without expert parallelism.

`resolve_expert_plan` reads and checks the plan before anything changes;
`apply_expert_parallel` applies it. What shards the local experts over the remaining
data-parallel ranks, and how their gradients are averaged, is the FSDP2 engine's
(`annot.engines.fsdp2_experts`).

transformers is imported inside the functions: ``import annot`` stays light.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from annot.huggingface.model import is_peft_model, is_pretrained_model

__all__ = ["ExpertParallelPlan", "apply_expert_parallel", "resolve_expert_plan"]

#: The styles of an ``ep_plan`` annot applies: the stacks split by expert, and the
#: experts module reached through the token exchange.
PARAM_STYLE = "grouped_gemm"
DISPATCH_STYLE = "ep_dispatch_experts"
#: transformers' token exchange for training (``AutoEP`` would pick the same one for any
#: call with gradients; naming it keeps evaluation on the same path).
IMPLEMENTATION = "all_to_all"


@dataclasses.dataclass(frozen=True)
class ExpertParallelPlan:
    """A model's expert-parallel plan, expanded to its modules.

    ``experts``: path of each experts module -> its expert count (the rows of each of
    its stacks); ``stacks``: path of each stacked parameter split by expert. Every
    stack's module is one of ``experts``."""

    experts: dict[str, int]
    stacks: tuple[str, ...]

    def styles(self) -> dict[str, str]:
        """The plan in transformers' form (path -> style), stacks before their module."""
        return {**dict.fromkeys(self.stacks, PARAM_STYLE),
                **dict.fromkeys(self.experts, DISPATCH_STYLE)}


def resolve_expert_plan(model: nn.Module, ep: int) -> ExpertParallelPlan:
    """``model``'s expert-parallel plan for ``ep`` ranks, checked before anything changes.

    The plan is a transformers model's ``ep_plan``; for any other model, its own
    ``ep_plan`` or else the experts modules annot's Plan finds (`_own_plan`). Raises
    ``ValueError`` naming the reason when there is none, when an experts module breaks
    transformers' experts contract (a model not transformers'), when the plan uses a
    style annot does not apply, or when an expert count does not divide by ``ep``. A
    PEFT wrapper is refused too: its adapters would see the experts split under them."""
    if is_peft_model(model):
        raise ValueError(
            f"expert parallelism (ep={ep}) on a PEFT model is not available: the adapters "
            "would wrap expert stacks split under them. Train the adapters with ep=1 (FSDP2 "
            "shards the fused experts over the data-parallel ranks)")
    expanded = _transformers_plan(model, ep) if is_pretrained_model(model) else _own_plan(model, ep)
    unknown = sorted({s for s in expanded.values() if s not in (PARAM_STYLE, DISPATCH_STYLE)})
    if unknown:
        raise ValueError(
            f"expert parallelism (ep={ep}): {type(model).__name__}'s ep_plan uses "
            f"{', '.join(map(repr, unknown))}; annot applies only {PARAM_STYLE!r} (stacks split "
            f"by expert) and {DISPATCH_STYLE!r} (tokens sent to their experts' ranks). Use ep=1")
    modules = dict(model.named_modules())
    experts = {path: _expert_count(model, path) for path, s in expanded.items()
               if s == DISPATCH_STYLE and path in modules}
    stacks = tuple(path for path, s in expanded.items() if s == PARAM_STYLE)
    if not experts:
        raise ValueError(f"expert parallelism (ep={ep}): {type(model).__name__}'s ep_plan matches "
                         "no experts module of this model. Use ep=1")
    problems = [f"{path} has {n} experts" for path, n in experts.items() if n % ep]
    problems += _coverage_problems(model, experts, stacks)
    orphans = [p for p in stacks if p.rpartition(".")[0] not in experts]
    if orphans:
        problems.append(f"stacks {orphans[:3]} lie outside every experts module")
    if problems:
        raise ValueError(f"expert parallelism (ep={ep}) cannot split {type(model).__name__}: "
                         f"{'; '.join(dict.fromkeys(problems))}. Choose an ep that divides the "
                         "expert count")
    return ExpertParallelPlan(experts=experts, stacks=stacks)


def _transformers_plan(model: nn.Module, ep: int) -> dict[str, str]:
    """A transformers model's ``ep_plan``, expanded to its paths by transformers."""
    rules = dict(getattr(model, "ep_plan", None) or {})
    if not rules:
        raise ValueError(
            f"expert parallelism (ep={ep}): {type(model).__name__} has no ep_plan (its config's "
            "base_model_ep_plan), so which modules hold experts is unknown. Use ep=1, or set "
            "model.ep_plan = {'layers.*.mlp.experts': 'ep_dispatch_experts', "
            "'layers.*.mlp.experts.gate_up_proj': 'grouped_gemm', ...}")
    return cast(Any, model)._expand_parallel_plan(rules)


def _own_plan(model: nn.Module, ep: int) -> dict[str, str]:
    """The plan of a model that is not a transformers model: its ``ep_plan`` where it has
    one (``*`` matching one path component), else every experts module annot's Plan
    finds (`annot.policies.experts`: a module holding 3-D stacks of one row per expert),
    each with all its parameters split by expert. Either way each experts module must
    keep transformers' experts contract (`_contract_problems`), which the token
    exchange relies on."""
    from annot.policies.experts import find_moe_blocks
    from annot.policies.model_index import ModelIndex

    rules = getattr(model, "ep_plan", None)
    if isinstance(rules, dict) and rules:
        expanded = _expand(model, rules)
    else:
        expanded = {}
        for block in find_moe_blocks(ModelIndex(model)):
            module = model.get_submodule(block.experts)
            expanded.update({f"{block.experts}.{n}": PARAM_STYLE for n, _ in module.named_parameters()})
            expanded[block.experts] = DISPATCH_STYLE
    if not expanded:
        raise ValueError(
            f"expert parallelism (ep={ep}): {type(model).__name__} has no experts module annot "
            "can find (a module holding 3-D stacks of one row per expert, transformers' layout) "
            "and no ep_plan. Use ep=1, or set model.ep_plan = {'layers.*.moe.experts': "
            "'ep_dispatch_experts', 'layers.*.moe.experts.gate_up_proj': 'grouped_gemm', ...}")
    modules = dict(model.named_modules())
    problems = [problem for path, style in expanded.items() if style == DISPATCH_STYLE and path in modules
                for problem in _contract_problems(path, modules[path])]
    if problems:
        raise ValueError(
            f"expert parallelism (ep={ep}) cannot split {type(model).__name__}: "
            f"{'; '.join(problems)}. annot splits experts through transformers' token exchange, "
            "which calls an experts module as transformers' own are called. Use ep=1 (FSDP2 "
            "shards the stacks like any parameter)")
    return expanded


def _expand(model: nn.Module, rules: dict[str, str]) -> dict[str, str]:
    """``rules`` (path patterns, ``*`` one component) -> the parameter paths (stack style)
    and module paths (other styles) they match."""
    import fnmatch

    def matches(path: str, pattern: str) -> bool:
        parts, wanted = path.split("."), pattern.split(".")
        return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, wanted, strict=True))

    modules, params = list(dict(model.named_modules())), list(dict(model.named_parameters()))
    # A stack style names parameters; any other style, modules (``experts.*`` is both).
    return {name: style for pattern, style in rules.items()
            for name in (params if style == PARAM_STYLE else modules) if matches(name, pattern)}


#: transformers' experts contract: forward's arguments, in order.
CONTRACT_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def _contract_problems(path: str, module: nn.Module) -> list[str]:
    """Why the experts module at ``path`` cannot be reached through transformers' token
    exchange, or ``[]``: it must take ``forward(hidden_states, top_k_index,
    top_k_weights)`` (the exchange calls it with each rank's tokens and their local
    expert ids) and hold an integer ``num_experts`` (set to the local count when split,
    so its forward must count its experts by it)."""
    import inspect

    problems = []
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool):
        problems.append(f"{path} ({type(module).__name__}) has no integer num_experts")
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(p.name for p in params[:3]) != CONTRACT_ARGUMENTS or any(
            p.default is p.empty for p in params[3:]):
        problems.append(f"{path}.forward takes ({', '.join(p.name for p in params)}), not "
                        f"({', '.join(CONTRACT_ARGUMENTS)})")
    return problems


def _coverage_problems(model: nn.Module, experts: dict[str, int], stacks: tuple[str, ...]) -> list[str]:
    """Every parameter of an experts module must be a stack of one row per expert: one
    the plan leaves out would be sharded over the copies only and drift apart across
    the ep ranks (each trains it on other tokens), silently."""
    problems, split = [], set(stacks)
    for path, count in experts.items():
        for name, param in model.get_submodule(path).named_parameters():
            full = f"{path}.{name}"
            if full not in split:
                problems.append(f"{full} is in an experts module but not split by expert (no "
                                f"{PARAM_STYLE!r} rule)")
            elif param.ndim == 0 or param.shape[0] != count:
                problems.append(f"{full} has {param.shape[0] if param.ndim else 0} rows, not one "
                                f"per expert ({count})")
    return problems


def _expert_count(model: nn.Module, path: str) -> int:
    """Rows of the experts module's stacks: its ``num_experts`` (the global count)."""
    module = model.get_submodule(path)
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int):
        raise ValueError(f"expert parallelism: {path} ({type(module).__name__}) has no integer "
                         "num_experts to split")
    return count


def apply_expert_parallel(model: nn.Module, plan: ExpertParallelPlan, ep_mesh: DeviceMesh,
                          tp_mesh: DeviceMesh) -> None:
    """Split ``plan``'s stacks by expert over ``ep_mesh`` and route the experts modules'
    tokens over it, in place (transformers' ``apply_expert_parallelism``). ``tp_mesh`` is
    the group of ranks that hold the same batch (one rank without tensor parallelism).
    Works on the meta device (no data moves: each rank keeps its slice of what it holds)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan.styles(), ep_implementation=IMPLEMENTATION)

