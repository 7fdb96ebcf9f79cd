"""annot's source rewriter: insert activation checkpointing into model code.

A libcst codemod (it imports libcst and the standard library only, never torch) that
wraps the block calls in a module class's methods in DeepSpeed's
``non_reentrant_checkpoint`` or torch's non-reentrant checkpoint, keeps every other byte,
and can undo itself.
``annot rewrite`` is the command line (`annot.rewriter.cli.main`).

Names are loaded on first use, so ``annot rewrite --help`` does not pay for libcst.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from annot.rewriter.codemod import RewriteResult, Site, SkippedSite, rewrite_source, undo_source
    from annot.rewriter.marks import marked_classes

__all__ = [
    "RewriteResult",
    "Site",
    "SkippedSite",
    "marked_classes",
    "rewrite_source",
    "undo_source",
]

_HOME = {name: f"{__name__}.codemod" for name in __all__} | {"marked_classes": f"{__name__}.marks"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
