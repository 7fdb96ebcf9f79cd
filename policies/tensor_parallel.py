"""Tensor-parallel plans: which module is split column-wise, which row-wise.

A plan is a mapping from module path to a style name, the vocabulary of transformers'
``base_model_tp_plan`` / ``_tp_plan`` (``"colwise"``, ``"rowwise"``,
``"colwise_gather_output"``, ``"embedding_rowwise"``, ...). It comes from one of:

- the model itself: a transformers model carries ``_tp_plan``, FQN patterns with ``*``
  standing for one path component (the layer index);
- a mapping of such patterns given by the user;
- `tp_rule`, for models that carry no plan: Linear layers named by their last path
  components (``"mlp.c_fc"``, ``"q_proj"``) are split column-wise or row-wise.

`resolve_tp_plan` turns any of them into concrete module paths and refuses a pattern
that matches nothing or a style annot cannot apply. Which torch ``ParallelStyle`` each
style becomes, and what the tensor-parallel size must divide, is the engine's business
(`annot.engines.tensor_parallel`). This module imports ``torch.nn`` only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from torch import nn

from annot.policies.errors import PlanError

__all__ = [
    "STYLES",
    "TensorParallelRule",
    "model_tp_plan",
    "resolve_tp_plan",
    "tp_rule",
]

#: Style names annot applies, with what each does (transformers' names; the torch
#: style each becomes is in `annot.engines.tensor_parallel`).
STYLES: dict[str, str] = {
    "colwise": "Linear split by output features; output stays split (the next rowwise "
               "layer takes it)",
    "colwise_gather_output": "Linear split by output features; output gathered whole",
    "colwise_rep": "Linear split by output features; output gathered whole",
    "rowwise": "Linear split by input features, input already split; output summed whole",
    "rowwise_split_input": "Linear split by input features, whole input split here; "
                           "output summed whole",
    "rowwise_rep": "Linear split by input features, whole input split here; output summed "
                   "whole",
    "embedding_rowwise": "Embedding split by vocabulary rows; lookups summed whole",
    "embedding_colwise": "Embedding split by hidden columns; lookups gathered whole",
    "replicate": "kept whole on every tensor-parallel rank",
}

# Styles of transformers' plans annot does not apply, with why (named in the refusal).
_REFUSED: dict[str, str] = {
    "packed_colwise": "a packed projection (gate and up in one weight) needs each half "
                      "split separately",
    "packed_rowwise": "a packed projection needs each half split separately",
    "sequence_parallel": "sequence parallelism changes the layout its neighbours receive",
    "replicated_with_grad_allreduce": "a norm over split heads needs its gradient summed "
                                      "over the tensor-parallel ranks outside FSDP2's reduction",
}


@dataclasses.dataclass(frozen=True)
class TensorParallelRule:
    """A tensor-parallel rule for a model without its own plan (see `tp_rule`)."""

    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    local_heads: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"tp_rule(colwise={list(self.colwise)}, rowwise={list(self.rowwise)})"

    def patterns(self) -> dict[str, str]:
        """Suffix patterns -> style."""
        return {**{p: "colwise" for p in self.colwise}, **{p: "rowwise" for p in self.rowwise}}


def tp_rule(*, colwise: Iterable[str] = (), rowwise: Iterable[str] = (),
            local_heads: Iterable[str] = ()) -> TensorParallelRule:
    """Split the Linear layers named in ``colwise`` by output features and those in
    ``rowwise`` by input features, the usual pairs of a transformer block: attention
    q/k/v column-wise and its output projection row-wise, MLP up/gate column-wise and
    down row-wise. Between a column-wise layer and its row-wise partner each rank holds
    its share of the features, so the block's collective is one all-reduce after the
    row-wise layer.

    Names are matched against the end of a module's path, component by component
    (``"mlp.c_fc"`` matches ``transformer.h.3.mlp.c_fc``; ``*`` stands for one
    component). Modules named in neither stay whole on every tensor-parallel rank
    (embeddings, norms, the head, unless named).

    ``local_heads``: attribute names holding head counts (``"n_head"``) on the modules
    whose Linear children are split. A forward that reshapes by such a count sees only
    its own rank's heads, so annot divides the attribute by the tensor-parallel size;
    a module carrying a head count the rule does not name is refused (the forward might
    reshape by it and mix heads silently).
    """
    rule = TensorParallelRule(_names(colwise, "colwise"), _names(rowwise, "rowwise"),
                              _names(local_heads, "local_heads"))
    if not rule.colwise and not rule.rowwise:
        raise ValueError("tp_rule() needs at least one name in colwise= or rowwise=")
    both = set(rule.colwise) & set(rule.rowwise)
    if both:
        raise ValueError(f"tp_rule(): {sorted(both)} named both colwise and rowwise")
    return rule


def _names(values: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(values, str):  # a bare string is one name, not its characters
        values = (values,)
    names = tuple(values)
    for name in names:
        if not isinstance(name, str) or not name or name.startswith(".") or name.endswith("."):
            raise ValueError(f"tp_rule({what}=...): {name!r} is not a module name")
    return names


def model_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan a transformers model carries (``_tp_plan``: patterns over
    the model's paths), found on ``model`` or the outermost module inside it that has
    one (a PEFT model, a module of yours holding the transformers model); ``None`` if
    none has one."""
    for path, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if isinstance(plan, Mapping) and plan:
            prefix = f"{path}." if path else ""
            return {prefix + pattern: str(style) for pattern, style in plan.items()}
    return None


def resolve_tp_plan(model: nn.Module,
                    source: TensorParallelRule | Mapping[str, str] | None) -> dict[str, str]:
    """Concrete module paths -> style, in module order.

    ``source``: a `tp_rule`, a mapping of full-path patterns (transformers' form) or
    ``None`` (the model's own plan, `model_tp_plan`). Raises `PlanError` when there is
    no plan, a pattern matches no module, a style is unknown or refused, or two
    patterns give one module different styles.
    """
    if source is None:
        plan = model_tp_plan(model)
        if plan is None:
            raise PlanError(
                f"{type(model).__name__} carries no tensor-parallel plan (_tp_plan): pass "
                "tp_plan=annot.tp_rule(colwise=[...], rowwise=[...]) naming the Linear "
                "layers to split, e.g. colwise=['q_proj', 'k_proj', 'v_proj', 'up_proj'], "
                "rowwise=['o_proj', 'down_proj']")
        patterns, full, origin = plan, True, f"{type(model).__name__}._tp_plan"
    elif isinstance(source, TensorParallelRule):
        patterns, full, origin = source.patterns(), False, source.name
    elif isinstance(source, Mapping):
        patterns, full, origin = {str(k): str(v) for k, v in source.items()}, True, "tp_plan"
    else:
        raise TypeError(f"tp_plan= takes annot.tp_rule(...), a mapping of module patterns "
                        f"to styles or None (the model's own), not {type(source).__name__}")
    paths = [path for path, _ in model.named_modules() if path]
    resolved: dict[str, str] = {}
    for pattern, style in patterns.items():
        _check_style(style, pattern, origin)
        regex = _pattern_regex(pattern, full)
        matched = [path for path in paths if regex.fullmatch(path)]
        if not matched:
            raise PlanError(f"{origin}: {pattern!r} matches no module of {type(model).__name__}"
                            + ("" if full else " (names match the end of a module's path)"))
        for path in matched:
            if resolved.get(path, style) != style:
                raise PlanError(f"{origin}: module {path} gets both {resolved[path]!r} and "
                                f"{style!r}")
            resolved[path] = style
    order = {path: i for i, path in enumerate(paths)}
    return dict(sorted(((p, s) for p, s in resolved.items() if s != "replicate"),
                       key=lambda item: order[item[0]]))


def _check_style(style: str, pattern: str, origin: str) -> None:
    if style in STYLES:
        return
    if style in _REFUSED:
        raise PlanError(f"{origin}: {pattern!r} asks for {style!r}, which annot does not "
                        f"apply ({_REFUSED[style]}); pass tp_plan= without it")
    raise PlanError(f"{origin}: {pattern!r} has unknown style {style!r}; annot applies "
                    f"{', '.join(STYLES)}")


def _pattern_regex(pattern: str, full: bool) -> re.Pattern[str]:
    """``*`` is one path component; a full pattern matches the whole path, a rule's name
    its last components."""
    body = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(body if full else rf"(?:.+\.)?{body}")
