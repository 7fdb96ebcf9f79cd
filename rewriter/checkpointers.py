"""Which calls are checkpoint calls, and which classes checkpoint inside themselves.

A class whose own methods call a checkpoint function (timm's ``ConvNeXtStage`` runs
``checkpoint_seq(self.blocks, x)`` when its flag is on) is already checkpointed inside:
wrapping a call of it as well would recompute its children a second time inside the
first recomputation, for no memory saved. `annot.rewriter.sites` reports such a call
instead of wrapping it.
"""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from annot.rewriter.containers import child_nodes
from annot.rewriter.imports import ImportTable

__all__ = ["checkpoint_function", "self_checkpointing"]

KNOWN_CHECKPOINTS = {
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
    "deepspeed.checkpointing.checkpoint",
    "deepspeed.checkpointing.non_reentrant_checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.non_reentrant_checkpoint",
}
# timm's helper lives in a private module that moved between releases; match its name.
KNOWN_CHECKPOINT_TAILS = {"checkpoint_seq", "checkpoint_sequential"}


def checkpoint_function(table: ImportTable, func: cst.BaseExpression) -> str | None:
    """The checkpoint function ``func`` calls (qualified, as the report shows it), or None."""
    if isinstance(func, cst.Attribute) and func.attr.value == "_gradient_checkpointing_func":
        return "transformers' _gradient_checkpointing_func"
    qualified = table.resolve(func)
    if qualified is None:
        return None
    if qualified in KNOWN_CHECKPOINTS or qualified.rpartition(".")[2] in KNOWN_CHECKPOINT_TAILS:
        return qualified
    return None


def self_checkpointing(
    module: cst.Module, table: ImportTable, cls: cst.ClassDef
) -> str | None:
    """How ``cls``'s own methods checkpoint what they call, for the report, or None.

    E.g. "`checkpoint_seq(self.blocks, x)` in ConvNeXtStage.forward, when
    `self.grad_checkpointing and not torch.jit.is_scripting()`". Nested classes are
    classes of their own and do not count.
    """
    if not isinstance(cls.body, cst.IndentedBlock):
        return None
    for method in cls.body.body:
        if not isinstance(method, cst.FunctionDef) or method.name.value == "__init__":
            continue
        for call, condition in _calls(method.body, None):
            name = checkpoint_function(table, call.func)
            if name is None:
                continue
            where = f"`{module.code_for_node(call)}` in {cls.name.value}.{method.name.value}"
            return where + (f", when `{condition}`" if condition else "")
    return None


def _calls(
    node: cst.CSTNode, condition: str | None
) -> Iterator[tuple[cst.Call, str | None]]:
    """Every call under ``node`` with the test of the innermost ``if`` it runs under."""
    if isinstance(node, cst.ClassDef):
        return
    if isinstance(node, cst.Call):
        yield node, condition
    if isinstance(node, cst.If):
        test = cst.Module([]).code_for_node(node.test)
        yield from _calls(node.test, condition)
        yield from _calls(node.body, test)
        if node.orelse is not None:
            yield from _calls(node.orelse, f"not ({test})")
        return
    for child in child_nodes(node):
        yield from _calls(child, condition)
