"""Read annot's class marks from source, without importing anything.

``@checkpoint_block``, ``@shard_block(checkpoint=True)`` (bare or called, under any import
alias, or as ``annot.checkpoint_block``) mark a class for checkpointing;
``enabled=False`` turns a mark off; a class without a decorator inherits from its bases
by name. Marks are collected per file (`class_marks`) and merged over all the files of
one run (`checkpointed_classes`), so a block defined in one file is found when it is
called from another.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from annot.rewriter._parse import parse_module
from annot.rewriter.imports import ImportTable, dotted_name

__all__ = ["ClassMark", "checkpointed_classes", "class_marks", "file_marks", "marked_classes"]

_CHECKPOINT = {"annot.checkpoint_block", "annot.markers.checkpoint_block"}
_SHARD = {"annot.shard_block", "annot.markers.shard_block"}
# Cheap textual filter: a file naming none of these cannot mark a class.
_MARKER_WORDS = ("checkpoint_block", "shard_block")


@dataclass(frozen=True)
class ClassMark:
    """What one class definition says: ``checkpoint`` is True/False, or None (inherit)."""

    name: str
    bases: tuple[str, ...]
    checkpoint: bool | None


def _keyword(call: cst.Call, name: str) -> bool | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            if isinstance(arg.value, cst.Name) and arg.value.value in ("True", "False"):
                return arg.value.value == "True"
    return None


def _decorator_says(dec: cst.Decorator, table: ImportTable) -> bool | None:
    expr = dec.decorator
    call = expr if isinstance(expr, cst.Call) else None
    qualified = table.resolve(call.func if call is not None else expr)
    if qualified not in _CHECKPOINT | _SHARD:
        return None
    enabled = _keyword(call, "enabled") if call is not None else None
    if qualified in _CHECKPOINT:
        return enabled is not False
    # shard_block: checkpointing only when asked; `enabled=False` turns the whole mark off.
    checkpoint = _keyword(call, "checkpoint") if call is not None else None
    if enabled is False and checkpoint is None:
        return False
    return checkpoint


def class_marks(module: cst.Module, table: ImportTable | None = None) -> list[ClassMark]:
    """Every class defined at module level (or nested in module-level ``if``), with its mark."""
    table = table or ImportTable.of(module)
    marks: list[ClassMark] = []
    for stmt in module.body:
        if not isinstance(stmt, cst.ClassDef):
            continue
        says: bool | None = None
        for dec in stmt.decorators:
            value = _decorator_says(dec, table)
            if value is not None:
                says = value
        bases = tuple(
            (dotted_name(arg.value) or "").rpartition(".")[2]
            for arg in stmt.bases
            if arg.keyword is None
        )
        marks.append(ClassMark(stmt.name.value, bases, says))
    return marks


def might_mark(source: str) -> bool:
    """False when ``source`` cannot mark a class (no marker name occurs in it)."""
    return any(word in source for word in _MARKER_WORDS)


def checkpointed_classes(marks: Iterable[ClassMark]) -> frozenset[str]:
    """Names of the checkpointed classes, merging over files and following bases by name.

    Names are what the source says; two classes of one name in one run are merged
    (any explicit True wins over inheritance), which is the best a text tool can do.
    """
    by_name: dict[str, list[ClassMark]] = {}
    for mark in marks:
        by_name.setdefault(mark.name, []).append(mark)
    memo: dict[str, bool] = {}

    def resolve(name: str, seen: frozenset[str]) -> bool:
        if name not in memo:
            result = False
            for mark in by_name.get(name, ()):
                if mark.checkpoint is not None:
                    result = result or mark.checkpoint
                else:
                    result = result or any(
                        resolve(b, seen | {name}) for b in mark.bases if b not in seen
                    )
            memo[name] = result
        return memo[name]

    return frozenset(name for name in by_name if resolve(name, frozenset()))


_CLASS_LINE = re.compile(r"^class\s+(\w+)\s*(?:\(([^)]*)\))?\s*:", re.MULTILINE)


def file_marks(source: str) -> list[ClassMark]:
    """`class_marks` of one file; a file naming no marker is only read for its classes'
    bases (a regex, no parse), which is all inheritance across files needs."""
    if might_mark(source):
        return class_marks(parse_module(source.lstrip("\ufeff")))
    return [
        ClassMark(
            m[1],
            tuple(b.strip().rpartition(".")[2] for b in (m[2] or "").split(",") if b.strip()),
            None,
        )
        for m in _CLASS_LINE.finditer(source)
    ]


def marked_classes(*sources: str) -> frozenset[str]:
    """The classes marked for checkpointing across ``sources`` (the files of one run)."""
    return checkpointed_classes(m for source in sources for m in file_marks(source))
