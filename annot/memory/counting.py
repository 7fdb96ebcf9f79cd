"""Counting live tensor bytes: the measuring stick of the memory planner.

`LiveBytes` is a ``TorchDispatchMode`` that sees the output of every tensor operation
run while it is active, remembers each new storage (by a weak reference, so it never
keeps one alive) with its size, and subtracts it when the storage is freed. Storages
resized in place are followed too: outputs of in-place and ``out=`` operations are
re-read after each operation, and ``torch.UntypedStorage.resize_`` (how FSDP2 frees and
re-allocates gathered parameters; no dispatch mode sees it) is wrapped while the mode
is active. The method is the one torch's own ``torch.distributed._tools.MemTracker``
uses, counting exact ``nbytes`` instead of rounding to an allocator's block size.

What it cannot see: storages created before it was entered (until an operation outputs
them), memory that is not a tensor (a CUDA context, NCCL's buffers, the caching
allocator's free blocks and fragmentation, pinned staging buffers a library allocates in
C++ without the dispatcher), and allocations on threads the mode is not active on. The
planner covers those with a stated margin (`annot.memory.report.MARGIN`).

It works on fake tensors too (under ``FakeTensorMode``: storages have sizes but no
memory), which is how the planner traces a training step without allocating.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["FlopCount", "LiveBytes", "storage_key", "storages_of"]


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage shared by every view of it (fake tensors too)."""
    return StorageWeakRef(t.untyped_storage()).cdata


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t`` (a wrapper subclass such as DTensor: its inner tensors')."""
    todo, found = [t], []
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
        else:
            found.append(x.untyped_storage())
    return found


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created while active: ``current``, ``peak`` (since the
    last `reset_peak`), and per-phase peaks (`phase`). ``on_change`` (optional) is called
    with the new ``current`` after every change, for timelines."""

    def __init__(self, on_change: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._excluded: set[int] = set()
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._on_change = on_change
        self._orig_resize: Any = None

    # -- bookkeeping -------------------------------------------------------------------
    def _set(self, key: int, nbytes: int) -> None:
        delta = nbytes - self._sizes.get(key, 0)
        if delta == 0:
            return
        self._sizes[key] = nbytes
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
        if self._phase is not None and self.current > self.phase_peaks.get(self._phase, 0):
            self.phase_peaks[self._phase] = self.current
        if self._on_change is not None:
            self._on_change(self.current)

    def _freed(self, key: int) -> None:
        nbytes = self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        if nbytes:
            self.current -= nbytes
            if self._on_change is not None:
                self._on_change(self.current)

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storages from now on (re-reads the size of known ones). Meta
        tensors hold no memory (fake tensors report the device they stand in for)."""
        if t.device.type == "meta":
            return
        for st in storages_of(t):
            key = id(st)
            if key in self._excluded:
                continue
            if key not in self._refs:
                self._refs[key] = weakref.ref(st, self._on_death(key))
            self._set(key, st.nbytes())

    def _on_death(self, key: int) -> Callable[[Any], None]:
        return lambda _ref: self._freed(key)

    def exclude(self, t: torch.Tensor) -> None:
        """Never count ``t``'s storages (kept alive by the caller: parameters accounted
        elsewhere, whose views every forward outputs)."""
        self._excluded.update(id(st) for st in storages_of(t))

    def bytes_of(self, t: torch.Tensor) -> int:
        """Bytes counted for ``t``'s storages (0 for storages not tracked)."""
        return sum(self._sizes.get(id(st), 0) for st in storages_of(t))

    # -- phases ------------------------------------------------------------------------
    def phase(self, name: str | None) -> None:
        """Attribute peaks from now on to ``name`` (``None``: to no phase)."""
        self._phase = name
        if name is not None:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)

    def reset_peak(self) -> None:
        self.peak = self.current

    # -- the mode ----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def __enter__(self) -> LiveBytes:
        self._orig_resize = torch.UntypedStorage.resize_
        orig, sizes = self._orig_resize, self._sizes

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            result = orig(st, size)
            if id(st) in sizes:
                self._set(id(st), st.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]


class FlopCount(TorchDispatchMode):
    """Floating-point operations of what runs while active, by torch's own per-operator
    formulas (``torch.utils.flop_counter``'s registry: matmuls, convolutions,
    attention). Torch's ``FlopCounterMode`` also tracks modules, through hooks that keep
    a checkpointed unit's recomputed activations alive under ``LiveBytes`` (measured:
    the traced peak of a checkpointed GPT grew 1.8x); this counts the total only.
    torch's registry lacks the CPU kernel of ``scaled_dot_product_attention`` (what a
    trace on the CPU or on fake tensors runs): it is counted by the formula of the GPU
    flash kernel, whose arguments begin alike."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        aten = torch.ops.aten
        self.registry = {
            **flop_registry,
            aten._scaled_dot_product_flash_attention_for_cpu:
                flop_registry[aten._scaled_dot_product_flash_attention],
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                flop_registry[aten._scaled_dot_product_flash_attention_backward],
        }
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out
