"""The copies activation offload makes, to the host and back: on a side CUDA stream, or
in order on the CPU.

One `Copier` per device. On CUDA (`StreamCopier`) every copy runs on one side stream,
so copies overlap the computation on the current stream: a copy to the host waits for
what the current stream queued so far (the tensor is being produced there), and the
source stays reserved for the side stream until the copy ran (``record_stream``); a
copy back is allocated on the current stream, filled on the side stream, and the
current stream waits for it (`Copier.wait`) only when backward reads it. All copies
share the one side stream, so a host buffer handed back to the pool after a copy may
be reused by the next copy without a host-side wait: the stream keeps their order.

On the CPU (`SyncCopier`) the same calls copy at once and waiting does nothing: CPU runs
take the same path through the offloader (its grouping, prefetch, buffer reuse and
counters) as GPU runs, with no stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Copier", "StreamCopier", "SyncCopier", "copier_for"]


class Copier(Protocol):
    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> None:
        """Start copying ``source`` into ``host`` (same shape and dtype)."""

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` to ``device``: (the new tensor, what `wait` needs)."""

    def wait(self, ready: Any) -> None:
        """Make the current stream wait until a `to_device` copy is complete."""


class SyncCopier:
    """Copies at once, on the calling thread (CPU tensors: nothing to overlap)."""

    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(source)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        # A new tensor even on the CPU: the host buffer goes back to the pool for reuse.
        return torch.empty_like(host, device=device).copy_(host), None

    def wait(self, ready: Any) -> None:
        return None


class StreamCopier:
    """Copies on one side stream of a CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(source, non_blocking=True)
        # The caching allocator must not give the source's memory to the current stream
        # before the side stream has read it (autograd drops it as soon as we return).
        source.record_stream(self.stream)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        current = torch.cuda.current_stream(device)
        target = torch.empty_like(host, device=device)  # the current stream's memory
        # The block may have been used by kernels the current stream has not run yet.
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            target.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # Freed unread (a branch backward never reaches): not reused before the copy ran.
        target.record_stream(self.stream)
        return target, done

    def wait(self, ready: Any) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)


def copier_for(device: torch.device) -> Copier:
    """The copier for tensors on ``device``: a side stream on CUDA, in order elsewhere."""
    return StreamCopier(device) if device.type == "cuda" else SyncCopier()
