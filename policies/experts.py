"""Mixture-of-experts blocks, found by the shape of their parameters.

transformers 5 keeps every expert of an MoE layer in one module holding 3-D stacks
(``experts.gate_up_proj`` of shape ``(num_experts, 2 * intermediate, hidden)``,
``experts.down_proj``), run by a grouped or batched matmul; the module holding that
experts module also holds the router (and the shared experts, where the family has them).
What the engines need from a Plan is exactly that pair, so it is found structurally,
independent of class names:

- an **experts module** holds, as its own parameters, at least one 3-D tensor, and all of
  its 3-D parameters have the same first dimension (the expert count, at least 2); its
  class is not one of ``torch.nn``'s (``Conv1d`` weights are 3-D too). A list of expert
  modules (``nn.ModuleList`` named ``experts``, the older layout) counts as well.
- its **MoE block** is the module holding it (``model.layers.0.mlp``): the unit DeepSpeed
  ZeRO-3 must gather whole (`annot.engines.deepspeed`), because which experts run depends
  on the tokens each rank routes.

A transformers model's ``_ep_plan`` names the same modules (``layers.*.mlp.experts``);
the structure is read instead, so that a model without one (a policy's own MoE, an older
family) is found too. Pure ``torch.nn``: this module is part of ``annot.policies``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from annot.policies.model_index import ModelIndex, parent_path

__all__ = ["ROUTER_NAMES", "MoeBlock", "describe_moe", "find_moe_blocks", "router_paths"]

#: Names a mixture-of-experts block gives the linear that routes tokens to its experts.
ROUTER_NAMES = ("gate", "router")


@dataclasses.dataclass(frozen=True)
class MoeBlock:
    """One MoE block of a model: its path and class, the experts module inside it, how
    many experts, which parameters are expert stacks, and their element count."""

    path: str
    cls: str
    experts: str
    experts_cls: str
    num_experts: int
    stacked: tuple[str, ...]  # the experts module's own parameters, by name
    expert_params: int  # elements of all experts together

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"stacked": list(self.stacked)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoeBlock:
        return cls(path=str(data["path"]), cls=str(data["cls"]), experts=str(data["experts"]),
                   experts_cls=str(data["experts_cls"]), num_experts=int(data["num_experts"]),
                   stacked=tuple(data["stacked"]), expert_params=int(data["expert_params"]))


def find_moe_blocks(index: ModelIndex) -> list[MoeBlock]:
    """Every MoE block of the indexed model, in module order (see the module docstring
    for what counts). A model without experts gives ``[]``."""
    blocks = []
    for path, module in index:
        if not path:
            continue  # the root is never an experts module: it has no block around it
        count = _stacked_expert_count(module) or _expert_list_count(path, module)
        if count is None:
            continue
        block = parent_path(path)
        params = [(n, p) for n, p in module.named_parameters()]
        blocks.append(MoeBlock(
            path=block, cls=type(index.modules[block]).__name__, experts=path,
            experts_cls=type(module).__name__, num_experts=count,
            stacked=tuple(n for n, p in params if "." not in n and p.dim() >= 2),
            expert_params=sum(p.numel() for _, p in params)))
    return blocks


def router_paths(model: nn.Module) -> set[str]:
    """Paths of the routers of ``model``: a linear named in `ROUTER_NAMES` beside an
    ``experts`` module. Quantization and float8 leave them in the model's dtype: a
    router's few logits decide which experts run, and rounding them changes the choice."""
    return {f"{path}.{child}" if path else child
            for path, module in model.named_modules()
            if hasattr(module, "experts")
            for child in ROUTER_NAMES if isinstance(getattr(module, child, None), nn.Linear)}


def _stacked_expert_count(module: nn.Module) -> int | None:
    """The shared first dimension of ``module``'s own 3-D parameters, or ``None`` when
    it holds none, they disagree, it is 1, or the class is torch's own (a 3-D conv)."""
    if type(module).__module__.startswith("torch."):
        return None
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if len(firsts) != 1:
        return None
    (count,) = firsts
    return count if count >= 2 else None


def _expert_list_count(path: str, module: nn.Module) -> int | None:
    """The length of a list of expert modules (``....experts`` as an ``nn.ModuleList``
    of at least two modules of one class), the pre-fusion layout some models keep."""
    if not isinstance(module, nn.ModuleList) or path.rpartition(".")[2] != "experts":
        return None
    classes = {type(m) for m in module}
    return len(module) if len(module) >= 2 and len(classes) == 1 else None


def describe_moe(blocks: list[MoeBlock] | tuple[MoeBlock, ...]) -> list[str]:
    """Lines for the Plan table: one per run of consecutive blocks that agree on all but
    the layer number (``model.layers.[0-1].mlp``), naming the experts module."""
    lines = []
    i = 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and _follows(blocks[i], blocks[j + 1], j + 1 - i):
            j += 1
        first = blocks[i]
        label = first.path if i == j else _run_label(blocks[i].path, blocks[j].path)
        experts = first.experts[len(first.path) + 1:]
        lines.append(
            f"moe: {label} ({first.cls}): {first.num_experts} experts in .{experts} "
            f"({first.experts_cls}; {', '.join(first.stacked) or 'a module list'}), "
            f"{first.expert_params:,} params{' each' if i != j else ''}")
        i = j + 1
    return lines


def _follows(first: MoeBlock, other: MoeBlock, steps: int) -> bool:
    """Whether ``other`` is ``first`` ``steps`` layers further down, alike in all else."""
    a, b = _layer_of(first.path), _layer_of(other.path)
    same = ((first.cls, first.experts[len(first.path):], first.experts_cls, first.num_experts,
             first.stacked, first.expert_params)
            == (other.cls, other.experts[len(other.path):], other.experts_cls, other.num_experts,
                other.stacked, other.expert_params))
    return same and a is not None and b is not None and (a[0], a[1] + steps, a[2]) == b


def _layer_of(path: str) -> tuple[str, int, str] | None:
    """``"model.layers.3.mlp"`` -> ``("model.layers", 3, "mlp")``: the last numbered name."""
    parts = path.split(".")
    for k in range(len(parts) - 1, -1, -1):
        if parts[k].isdigit():
            return ".".join(parts[:k]), int(parts[k]), ".".join(parts[k + 1:])
    return None


def _run_label(first: str, last: str) -> str:
    a, b = _layer_of(first), _layer_of(last)
    assert a is not None and b is not None
    tail = f".{a[2]}" if a[2] else ""
    return f"{a[0]}.[{a[1]}-{b[1]}]{tail}"
