"""Is a block call an MoE expert dispatch?

A mixture-of-experts layer loops over its experts and runs each on the tokens routed to
it (litgpt's ``LLaMAMoE``: ``y[token_idx] += probs[...] * expert(x[token_idx])``). Such a
loop is not the model's trunk: the layer holding the MoE is the block to checkpoint, and
wrapping each expert as well recomputes it inside the outer recomputation (or, without
an outer one, checkpoints many tiny per-expert calls whose inputs are kept anyway for
the routing). In trunk mode the rewriter reports these loops instead of wrapping them.
"""

from __future__ import annotations

import libcst as cst

from annot.rewriter.containers import Container
from annot.rewriter.imports import dotted_name

__all__ = ["expert_dispatch", "holds_experts"]

# Tensor methods that scatter per-expert outputs back into the token order.
_SCATTERS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_copy", "index_copy_"}


def expert_dispatch(
    call: cst.Call, statement: cst.BaseSmallStatement, container: Container
) -> str | None:
    """Why ``call`` (of an element of ``container``, in ``statement``) is an expert
    dispatch, for the report; None when nothing says it is."""
    named = holds_experts(container)
    if named is not None:
        return named
    if _runs_on_routed_tokens(call) and _scatters_back(call, statement):
        return "each element runs on the tokens routed to it and its output is scattered back"
    return None


def holds_experts(container: Container) -> str | None:
    """Why ``container``'s name or classes say it holds MoE experts, or None."""
    attribute = container.path.split("[", 1)[0].rpartition(".")[2]
    if "expert" in attribute.lower():
        return f"`self.{container.path}` holds MoE experts"
    expert_classes = [name for name in container.classes if "expert" in name.lower()]
    if expert_classes:
        return f"its elements are MoE experts ({', '.join(expert_classes)})"
    return None


def _runs_on_routed_tokens(call: cst.Call) -> bool:
    """A positional argument indexed by something other than a constant: ``x[token_idx]``."""
    for arg in call.args:
        value = arg.value
        if arg.keyword is None and isinstance(value, cst.Subscript):
            index = value.slice[0].slice if len(value.slice) == 1 else None
            if not (isinstance(index, cst.Index) and isinstance(index.value, cst.Integer)):
                return True
    return False


def _scatters_back(call: cst.Call, statement: cst.BaseSmallStatement) -> bool:
    """The call's value lands in an indexed target or an ``index_add_``-style scatter."""
    targets: list[cst.BaseExpression] = []
    if isinstance(statement, cst.AugAssign):
        targets = [statement.target]
    elif isinstance(statement, cst.Assign):
        targets = [t.target for t in statement.targets]
    if any(isinstance(t, cst.Subscript) for t in targets):
        return True
    value = getattr(statement, "value", None)
    while isinstance(value, cst.Call):
        name = (dotted_name(value.func) or "").rpartition(".")[2]
        if name in _SCATTERS and any(_holds(arg.value, call) for arg in value.args):
            return True
        value = value.func.value if isinstance(value.func, cst.Attribute) else None
    return False


def _holds(node: cst.CSTNode, call: cst.Call) -> bool:
    if node is call:
        return True
    return any(_holds(child, call) for child in node.children)
