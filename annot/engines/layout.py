"""Which engine sharded a model, asked of each engine module in turn."""

from __future__ import annotations

from torch import nn

from annot.engines import deepspeed, fsdp1
from annot.meta.layout import ShardLayout

__all__ = ["shard_layout"]


def shard_layout(model: nn.Module) -> ShardLayout:
    """Where this rank keeps ``model``'s parameters, whichever engine sharded it (FSDP2
    parameters are DTensors, which describe themselves: an empty layout)."""
    return fsdp1.shard_layout(model).merged(deepspeed.shard_layout(model))
