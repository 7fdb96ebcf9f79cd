"""Allocating a meta model one shard unit at a time, for engines that shard real tensors.

FSDP1 and DeepSpeed ZeRO-3 cannot shard a meta tensor; they shard what a unit holds
when they reach it. `UnitAllocator` gives a unit's tensors storage right before that
(undefined values: `annot.materialize` fills the shards afterwards), so a rank holds the
full tensors of about one unit at a time rather than of the whole model.
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from annot.meta.deferred import deferred_init_of
from annot.module_state import module_state, peek_state

__all__ = ["UnitAllocator", "module_tensors", "unit_allocation_peak"]


class UnitAllocator:
    """Call it on a module of a meta ``model`` to give that module's own meta parameters
    and buffers storage on ``device`` (values undefined, for `annot.materialize` to fill)
    just before an engine shards the unit the module belongs to (FSDP1's
    ``param_init_fn``; before ``deepspeed.zero.Init(module=...)``). A tensor several
    modules share (tied weights) gets one allocation, so the tie survives
    (``nn.Module.to_empty`` would give each module its own copy).

    ``peak_bytes``: the most bytes of these allocations alive at once (FSDP1 frees a
    unit's full tensors once it has sharded them, ZeRO-3 once it has partitioned them),
    counted by their storages."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        uses = Counter(id(t) for t in module_tensors(model))
        self.shared = {i for i, n in uses.items() if n > 1}
        self.allocated: dict[int, torch.Tensor] = {}  # shared tensors only
        self.alive: list[tuple[StorageWeakRef, int]] = []
        self.peak_bytes = 0
        self.record = deferred_init_of(model)

    def __call__(self, module: nn.Module) -> None:
        # cast: a Parameter is replaced by a Parameter (below); the dict types are invariant.
        for holder in (cast("dict[str, torch.Tensor | None]", module._parameters), module._buffers):
            for name, tensor in holder.items():
                if tensor is None or not tensor.is_meta:
                    continue
                real = self.allocated.get(id(tensor))
                if real is None:
                    real = torch.empty_like(tensor, device=self.device)
                    if isinstance(tensor, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                    if self.record is not None:
                        self.record.pending = True
                    storage = real.untyped_storage()
                    self.alive.append((StorageWeakRef(storage), storage.nbytes()))
                    if id(tensor) in self.shared:
                        self.allocated[id(tensor)] = real
                holder[name] = real
        self.alive = [(ref, n) for ref, n in self.alive if not ref.expired()]
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self.alive))

    def record_on(self, module: nn.Module) -> None:
        """Keep ``peak_bytes`` on ``module`` for `unit_allocation_peak` (if it allocated)."""
        if self.peak_bytes:
            module_state(module).unit_allocation_peak = self.peak_bytes


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer as each module holds it (a shared one once per holder)."""
    return [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None]


def unit_allocation_peak(model: nn.Module) -> int | None:
    """Peak bytes of full tensors alive at once while an engine (`auto_wrap` with FSDP1 or
    DeepSpeed ZeRO-3) allocated the meta ``model`` unit by unit; ``None`` if it did not.
    The engine's own transient copies (FSDP1 flattens a unit) come on top of it."""
    state = peek_state(model)
    return state.unit_allocation_peak if state is not None else None
