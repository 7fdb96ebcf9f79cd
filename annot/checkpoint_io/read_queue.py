"""The reads of one load, queued, then run in large pieces on a few threads.

`annot.load` first decides, tensor by tensor, which bytes of which file go where (the
key matching and block arithmetic of `annot.checkpoint_io.loading`), and queues each read
here; `ReadQueue.run` then does them all:

- a **direct** read (the file's dtype, a contiguous CPU destination) goes from the page
  cache into the destination's own memory in one copy, cut into `CHUNK`-byte pieces run
  on `threads` threads (``os.preadv`` releases the GIL): a cold read keeps several
  requests in flight on the disk, and the first touch of the destination's new pages
  is shared among the threads;
- a **staged** read (another dtype, or a destination on a GPU) goes through two staging
  buffers in turn: while one buffer's bytes are copied (converted) into the destination,
  the next piece is read into the other. For a CUDA destination the buffers are pinned
  and the copy is asynchronous (``non_blocking``), so the disk read of piece i+1
  overlaps the host-to-device copy of piece i; an event per buffer says when it may be
  refilled. On the CPU the same loop runs with plain buffers and a synchronous copy.

Nothing here knows a model: it moves bytes between (file, offset) and tensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from annot.errors import CheckpointError

__all__ = ["CHUNK", "ReadQueue", "read_threads"]

#: Bytes per piece of a read: large enough that a piece costs one system call among
#: milliseconds of copying, small enough that a few threads share one tensor's read.
CHUNK = 16 * 2**20
THREADS_VARIABLE = "ANNOT_READ_THREADS"


def read_threads() -> int:
    """Threads a load reads with: ``ANNOT_READ_THREADS`` if set, else 4. More than one
    keeps a cold disk busy (several requests in flight) whatever the CPU count; a warm
    read is a memory copy, which gains little past the cores a rank has."""
    value = os.environ.get(THREADS_VARIABLE)
    if value is None:
        return 4
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE}={value!r}: expected a whole number >= 1")
    return int(value)


@dataclasses.dataclass(frozen=True)
class _Read:
    """``nbytes`` bytes of ``path`` from ``offset`` into ``out`` (a flat byte view, or
    for a staged read the flat destination, elements ``[first, first + count)`` of the
    file's dtype ``dtype``)."""

    path: Path
    label: str  # the tensor's key, for errors
    offset: int
    out: torch.Tensor
    dtype: torch.dtype = torch.uint8


class ReadQueue:
    """Reads queued with `direct` and `staged`, done by `run` (call it once; the
    destinations hold their values only after it returns)."""

    def __init__(self, threads: int | None = None, chunk: int | None = None) -> None:
        self.threads = read_threads() if threads is None else threads
        chunk = CHUNK if chunk is None else chunk
        if self.threads < 1 or chunk < 16:  # a piece holds at least two of any element
            raise ValueError(f"threads={self.threads} must be >= 1 and chunk={chunk} >= 16")
        self.chunk = chunk
        self._direct: list[_Read] = []
        self._staged: list[_Read] = []

    def direct(self, path: Path, label: str, offset: int, out: torch.Tensor) -> int:
        """Queue reading ``out.nbytes`` bytes at ``offset`` into ``out`` (contiguous, on
        the CPU); returns the bytes queued."""
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{label}: a direct read needs a contiguous CPU tensor")
        if out.numel():
            self._direct.append(_Read(path, label, offset, out.detach().reshape(-1).view(torch.uint8)))
        return out.numel() * out.element_size()

    def staged(self, path: Path, label: str, offset: int, out: torch.Tensor,
               dtype: torch.dtype) -> int:
        """Queue filling ``out`` (contiguous, any device and floating dtype) with
        ``out.numel()`` elements of ``dtype`` stored at ``offset``, converted on the way;
        returns the bytes queued (the file's)."""
        if not out.is_contiguous():
            raise ValueError(f"{label}: a staged read needs a contiguous destination")
        if out.numel():
            self._staged.append(_Read(path, label, offset, out.detach().reshape(-1), dtype))
        return out.numel() * dtype.itemsize

    def run(self) -> None:
        """Do every queued read: the direct ones on the thread pool, the staged ones on
        this thread meanwhile (their copies are this thread's work)."""
        fds: dict[Path, int] = {}
        try:
            for read in [*self._direct, *self._staged]:
                if read.path not in fds:
                    fds[read.path] = _open(read.path)
            pieces = list(self._pieces())
            if not pieces:
                self._run_staged(fds)
                return
            with ThreadPoolExecutor(min(self.threads, len(pieces)),
                                    thread_name_prefix="annot-read") as pool:
                futures = [pool.submit(_pread_all, fds[read.path], read.label, offset, view)
                           for read, offset, view in pieces]
                self._run_staged(fds)
                for future in futures:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)
            self._direct.clear()
            self._staged.clear()

    def _pieces(self) -> Iterator[tuple[_Read, int, memoryview]]:
        for read in self._direct:
            view = read.out.numpy().data.cast("B")
            for start in range(0, len(view), self.chunk):
                yield read, read.offset + start, view[start:start + self.chunk]

    def _run_staged(self, fds: dict[Path, int]) -> None:
        if not self._staged:
            return
        cuda = any(read.out.device.type == "cuda" for read in self._staged)
        # Pinned only where a GPU copies from them: pinning needs a CUDA context.
        buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        events: list[Any] = [None, None]
        turn = 0
        for read in self._staged:
            itemsize = read.dtype.itemsize
            per_piece = self.chunk // itemsize
            for first in range(0, read.out.numel(), per_piece):
                count = min(per_piece, read.out.numel() - first)
                buffer = buffers[turn]
                if events[turn] is not None:
                    events[turn].synchronize()  # its previous copy to the GPU is done
                view = buffer.numpy().data.cast("B")[:count * itemsize]
                _pread_all(fds[read.path], read.label, read.offset + first * itemsize, view)
                source = buffer[:count * itemsize].view(read.dtype)
                destination = read.out[first:first + count]
                if destination.device.type == "cuda":
                    destination.copy_(source, non_blocking=True)
                    events[turn] = torch.cuda.Event()
                    events[turn].record()
                else:
                    destination.copy_(source)
                turn = 1 - turn
        for event in events:
            if event is not None:
                event.synchronize()


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _pread_all(fd: int, label: str, offset: int, view: memoryview) -> None:
    done = 0
    try:
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:  # the file shrank after its header was checked
                raise CheckpointError(f"{label}: the file ends before its data")
            done += got
    except OSError as exc:
        raise CheckpointError(f"{label}: cannot read ({exc.strerror or exc})") from None
