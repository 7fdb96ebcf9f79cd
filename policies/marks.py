"""The vocabulary of actions and the metadata that markers attach to classes and modules.

`annot`'s decorators write a `Mark`; the `marked(...)` rule reads it. Both sides meet
here so that `policies` never imports `annot` (docs/design.md: annot -> annot.policies only).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

__all__ = [
    "Action",
    "Mark",
    "MARK_ATTR",
    "OffloadTarget",
    "OFFLOAD_TARGETS",
    "effective_mark",
    "own_mark",
]

OffloadTarget = Literal["cpu", "nvme"]
OFFLOAD_TARGETS: tuple[str, ...] = ("cpu", "nvme")

# Name of the attribute holding a Mark, on a class (in its own __dict__) or on a module
# instance (in the instance __dict__). A plain attribute changes nothing about the class:
# not forward, not state_dict keys, not repr, not pickling.
MARK_ATTR = "_annot_mark"


class Action(str, enum.Enum):
    """What a Plan unit asks the engine to do with a module."""

    SHARD = "shard"
    CHECKPOINT = "checkpoint"
    OFFLOAD = "offload"
    #: The unit's eligible linears compute their matmuls in float8 (`annot.float8`).
    FLOAT8 = "float8"
    #: The unit's forward is compiled (`annot.compiled_blocks`), after wrapping.
    COMPILE = "compile"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Mark:
    """Per-class or per-module intent. ``None`` means "not said here": inherit it.

    ``offload`` is ``False`` (explicitly not offloaded), ``None`` (inherit) or a target
    in `OFFLOAD_TARGETS`.
    """

    shard: bool | None = None
    checkpoint: bool | None = None
    offload: bool | str | None = None

    def __post_init__(self) -> None:
        for name in ("shard", "checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"Mark.{name} must be True, False or None, got {value!r}")
        if self.offload is True:
            object.__setattr__(self, "offload", "cpu")
        if self.offload not in (None, False, *OFFLOAD_TARGETS):
            raise ValueError(
                f"offload must be one of {OFFLOAD_TARGETS}, False or None, got {self.offload!r}"
            )

    def over(self, base: Mark) -> Mark:
        """This mark's stated fields on top of ``base`` (the inherited one)."""
        return Mark(
            shard=base.shard if self.shard is None else self.shard,
            checkpoint=base.checkpoint if self.checkpoint is None else self.checkpoint,
            offload=base.offload if self.offload is None else self.offload,
        )

    def actions(self) -> frozenset[Action]:
        """The actions this mark asks for (unstated fields count as off)."""
        out = set()
        if self.shard:
            out.add(Action.SHARD)
        if self.checkpoint:
            out.add(Action.CHECKPOINT)
        if self.offload:
            out.add(Action.OFFLOAD)
        return frozenset(out)

    @property
    def offload_target(self) -> str | None:
        return self.offload if isinstance(self.offload, str) else None

    def is_empty(self) -> bool:
        return not self.actions()


def own_mark(obj: Any) -> Mark | None:
    """The Mark set directly on ``obj`` (a class or an instance), not inherited."""
    mark = vars(obj).get(MARK_ATTR) if hasattr(obj, "__dict__") else None
    return mark if isinstance(mark, Mark) else None


def effective_mark(module: Any) -> Mark:
    """The Mark that applies to a module instance.

    Classes are merged from the most basic to the most derived (so a subclass overrides
    what it states and inherits the rest), then the instance's own mark goes on top.
    """
    mark = Mark()
    for klass in reversed(type(module).__mro__):
        own = own_mark(klass)
        if own is not None:
            mark = own.over(mark)
    own = own_mark(module)
    if own is not None:
        mark = own.over(mark)
    return mark
