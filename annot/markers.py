"""Class decorators and `mark()`: they record intent and change nothing else.

A decorated class keeps its forward, ``state_dict`` keys, repr, pickling and
``torch.compile`` behaviour: the only effect is one plain attribute holding a
`policies.Mark`, read later by the planner (see `policies.marked`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from torch import nn

from annot.policies.marks import MARK_ATTR, Mark, effective_mark, own_mark

__all__ = ["shard_block", "checkpoint_block", "offload_block", "mark", "unmark", "get_mark"]

C = TypeVar("C", bound=type)


def _attach(target: Any, mark: Mark) -> None:
    """Merge ``mark`` over what ``target`` itself already says (stacked decorators)."""
    merged = mark.over(own_mark(target) or Mark())
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(f"annot markers apply to nn.Module classes, not {target.__qualname__}")
        setattr(target, MARK_ATTR, merged)
    elif isinstance(target, nn.Module):
        # Straight into __dict__: nn.Module.__setattr__ would be fine too, but this makes
        # plain that the mark is neither a parameter, a buffer nor a submodule.
        target.__dict__[MARK_ATTR] = merged
    else:
        raise TypeError(
            f"annot markers apply to nn.Module classes or instances, got {type(target).__name__}"
        )


def _decorator(cls: C | None, mark: Mark) -> C | Callable[[C], C]:
    def apply(klass: C) -> C:
        _attach(klass, mark)
        return klass

    return apply if cls is None else apply(cls)


@overload
def shard_block(cls: C, /) -> C: ...
@overload
def shard_block(
    *, enabled: bool = True, checkpoint: bool | None = None, offload: bool | str | None = None
) -> Callable[[C], C]: ...
def shard_block(
    cls: C | None = None,
    /,
    *,
    enabled: bool = True,
    checkpoint: bool | None = None,
    offload: bool | str | None = None,
) -> C | Callable[[C], C]:
    """Mark a module class as a shard unit (one FSDP/ZeRO-3 group).

    ``@shard_block`` or ``@shard_block(checkpoint=True, offload="cpu")``.
    ``enabled=False`` turns off a mark inherited from a base class.
    """
    return _decorator(cls, Mark(shard=enabled, checkpoint=checkpoint, offload=offload))


@overload
def checkpoint_block(cls: C, /) -> C: ...
@overload
def checkpoint_block(*, enabled: bool = True) -> Callable[[C], C]: ...
def checkpoint_block(cls: C | None = None, /, *, enabled: bool = True) -> C | Callable[[C], C]:
    """Mark a module class for activation checkpointing (recompute in backward)."""
    return _decorator(cls, Mark(checkpoint=enabled))


@overload
def offload_block(cls: C, /) -> C: ...
@overload
def offload_block(*, to: str | bool = "cpu") -> Callable[[C], C]: ...
def offload_block(cls: C | None = None, /, *, to: str | bool = "cpu") -> C | Callable[[C], C]:
    """Mark a module class for offload to ``"cpu"`` or ``"nvme"``; ``to=False`` turns it off."""
    return _decorator(cls, Mark(offload=to))


def mark(
    target: type[nn.Module] | nn.Module,
    *,
    shard: bool | None = None,
    checkpoint: bool | None = None,
    offload: bool | str | None = None,
) -> None:
    """Mark a class you do not own (``mark(LlamaDecoderLayer, shard=True)``) or one module
    instance (``mark(model.layers[0], checkpoint=False)``). Unstated options are inherited;
    an instance's mark overrides its class's."""
    _attach(target, Mark(shard=shard, checkpoint=checkpoint, offload=offload))


def unmark(target: type[nn.Module] | nn.Module) -> None:
    """Remove the mark set directly on ``target`` (marks inherited from bases remain)."""
    holder = vars(target)
    if MARK_ATTR in holder:
        if isinstance(target, type):
            delattr(target, MARK_ATTR)
        else:
            del target.__dict__[MARK_ATTR]


def get_mark(module: nn.Module) -> Mark:
    """The mark in force for ``module``: its classes' marks merged, then its own."""
    return effective_mark(module)
