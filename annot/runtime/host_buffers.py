"""Host buffers reused from one training step to the next (activation offload's).

Allocating pinned memory is slow (``cudaHostAlloc`` maps and locks pages, milliseconds
per buffer) and a training step saves the same shapes every time, so a buffer handed
back goes on a free list by its size and the next request of that size takes it again.
The free list never holds more bytes than were ever in use at once, so a run whose
shapes change (another sequence length) keeps at most twice its peak.

Buffers are pinned while this pool's pinned bytes fit the rank's budget
(`annot.host_memory.pin_host_memory`); past it they are pageable, with one warning.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from annot.host_memory import pin_host_memory

__all__ = ["HostBufferPool"]


class HostBufferPool:
    """Flat ``uint8`` host buffers by exact size.

    ``pin``: whether to ask for pinned buffers at all (the offloaded tensors are on CUDA).
    Counters: ``made`` buffers allocated, ``reused`` requests served from the free list,
    ``in_use_bytes`` / ``peak_bytes`` handed out now / at most, ``pinned_bytes`` of all
    buffers this pool made that are pinned.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.made = self.reused = 0
        self.in_use_bytes = self.peak_bytes = self.pinned_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._warned = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` bytes (its contents are undefined)."""
        free = self._free.get(nbytes)
        if free:
            buffer = free.pop()
            self._free_bytes -= nbytes
            self.reused += 1
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin_next(nbytes))
            self.made += 1
            if buffer.is_pinned():
                self.pinned_bytes += nbytes
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` for reuse; the caller must no longer read or write it (on
        CUDA: every copy from or into it is queued on the one stream later copies use)."""
        nbytes = buffer.numel()
        self.in_use_bytes -= nbytes
        if self._free_bytes + nbytes > self.peak_bytes:
            if buffer.is_pinned():  # dropped: freed with its last reference
                self.pinned_bytes -= nbytes
            return
        self._free[nbytes].append(buffer)
        self._free_bytes += nbytes

    def _pin_next(self, nbytes: int) -> bool:
        if not self.pin:
            return False
        # One warning per pool: every later buffer would repeat it.
        pin = pin_host_memory(self.pinned_bytes + nbytes, "activation offload's host buffers",
                              device="cuda", warn=not self._warned)
        self._warned = self._warned or not pin
        return pin
