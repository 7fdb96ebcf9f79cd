"""What a save writes, one tensor at a time: `Entry` (a name, the full shape and dtype, and
how to fetch the whole tensor) and the fetch for a (possibly sharded) model tensor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from annot.errors import CheckpointError
from annot.meta.layout import ShardLayout

__all__ = ["Entry", "entry", "full_shape", "full_tensor"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor to write: its name in the file, its full shape and dtype, and
    ``fetch()``, which returns the whole tensor (collective for a sharded one: every rank
    calls it, in the same order)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]
    #: The model's tensor and where the engine keeps it, when the entry is one (not a
    #: PEFT merge): a save where ranks write their own ranges reads them.
    source: torch.Tensor | None = None
    layout: ShardLayout | None = None


def entry(name: str, tensor: torch.Tensor, layout: ShardLayout) -> Entry:
    return Entry(name, full_shape(tensor, layout), tensor.dtype, lambda: full_tensor(tensor, layout),
                 tensor, layout)


def full_shape(tensor: torch.Tensor, layout: ShardLayout) -> tuple[int, ...]:
    parts = layout.parts.get(id(tensor))
    return tuple(parts[0].full_shape) if parts else tuple(tensor.shape)


def full_tensor(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The whole of ``tensor`` (collective for a sharded one), detached, on the CPU."""
    if id(tensor) in layout.parts:
        if layout.gather is None:
            raise CheckpointError(f"the {layout.engine} layout cannot gather a parameter")
        return layout.gather(tensor).detach().cpu()
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu()

