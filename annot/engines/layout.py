"""Questions about a model whichever engine wrapped it, asked of every engine in turn."""

from __future__ import annotations

from torch import nn

from annot.engines.registry import all_engines
from annot.meta.layout import WHOLE, ShardLayout

__all__ = ["after_write", "shard_layout"]


def shard_layout(model: nn.Module) -> ShardLayout:
    """Where this rank keeps ``model``'s parameters, whichever engine sharded it (FSDP2
    parameters are DTensors, which describe themselves: an empty layout)."""
    layout = WHOLE
    for engine in all_engines():
        layout = layout.merged(engine.layout(model))
    return layout


def after_write(model: nn.Module) -> None:
    """Tell every engine that annot wrote values into ``model``'s parameters on this
    rank (`annot.engines.base.Engine.after_write`: ZeRO++ hpZ's copies are dropped)."""
    for engine in all_engines():
        engine.after_write(model)
