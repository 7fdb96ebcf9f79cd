"""`init_distributed`: the process group with a bound on how long a stuck rank can hold
the job, and a heartbeat that names the rank.

torch's default collective timeout is 30 minutes: a rank that is stopped (SIGSTOP, a
debugger, a swapped-out host) rather than dead keeps every other rank waiting that long,
and the eventual error ("Timed out waiting ... for recv") names no rank. Here the
process-group timeout is the bound, and each rank runs a daemon thread that bumps a
counter in torchrun's key-value store every ``timeout / 10`` seconds (at most 1 s) and
watches the next rank's counter: a rank whose counter has not moved for half of
``timeout`` is named on stderr, once, before the collectives waiting on it fail at
``timeout`` (docs/design.md, pitfall 20).

The thread only reports; ending the job is the collectives' timeout and torchrun's work
(``torchrun --shutdown_timeout`` bounds how long torchrun waits for a stopped rank after
asking it to stop; it defaults to 30 s).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from annot.devices import choose_device, distributed_backend, uses_cuda

__all__ = ["DEFAULT_TIMEOUT_S", "barrier", "init_distributed", "rank_and_world"]

DEFAULT_TIMEOUT_S = 600.0  # long enough for a checkpoint save, far below torch's 30 minutes
_DONE = "done"


def init_distributed(backend: str | None = None, *, device: torch.device | str | None = None,
                     timeout: float = DEFAULT_TIMEOUT_S, heartbeat: bool = True) -> torch.device:
    """``torch.distributed.init_process_group`` for a torchrun (or srun) launch, with
    collectives bounded by ``timeout`` seconds and (``heartbeat=True``) a report naming any
    rank that stops answering for that long. Returns this rank's device.

    The device is `annot.devices.choose_device` of ``device`` and ``backend``: this rank's
    GPU (``LOCAL_RANK % device_count``, made current) when CUDA is available and torchrun
    does not start more ranks on the node than it has GPUs, else the CPU; ``"cuda"`` or
    ``"cpu"`` forces it. ``backend`` defaults to the device's
    (`annot.devices.distributed_backend`): ``"cpu:gloo,cuda:nccl"`` on CUDA (NCCL for CUDA
    tensors, gloo for CPU ones), ``"gloo"`` on the CPU. A CUDA device with an NCCL backend
    is passed as ``device_id``: NCCL connects at once, and sub-groups split its
    communicator instead of building full ones.

    Reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); raises ``RuntimeError`` naming what is missing when it is not set.
    When the process group already exists, only returns the device."""
    if dist.is_initialized():
        return choose_device(device)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"annot.init_distributed: {', '.join(missing)} not set; start the script "
                           "with torchrun (e.g. torchrun --nproc_per_node 2 train.py)")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    chosen = choose_device(device, backend=backend)
    backend = backend or distributed_backend(chosen)
    device_id = chosen if chosen.type == "cuda" and uses_cuda(backend) else None
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device_id)
    if heartbeat and dist.get_world_size() > 1:
        _Heartbeat(timeout).start()
    return chosen


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; ``(0, 1)``
    without one (one process: the same code runs alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """A barrier of the default process group; nothing without one."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class _Heartbeat(threading.Thread):
    """Bump this rank's counter and name ranks whose counters stop (module docstring)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(name="annot-heartbeat", daemon=True)
        self.timeout = timeout
        self.interval = min(1.0, timeout / 10)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # A client of its own: the process group's store is in use by the main thread.
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=datetime.timedelta(seconds=timeout))
        self.store.set(f"annot/who/{self.rank}", f"{socket.gethostname()} pid {os.getpid()}")
        self.store.set(f"annot/beat/{self.rank}", "0")
        self.stopped = threading.Event()
        atexit.register(self.stop)

    def stop(self) -> None:
        """This rank is leaving on purpose: others must not report it."""
        self.stopped.set()
        try:
            self.store.set(f"annot/beat/{self.rank}", _DONE)
        except Exception:  # noqa: BLE001 - the store may already be gone at exit
            pass

    def run(self) -> None:
        # Each rank watches the next one (a ring): every rank is watched by one other,
        # and the store serves two requests per rank per interval at any world size.
        watched = (self.rank + 1) % self.world
        key = f"annot/beat/{watched}"
        last: tuple[bytes | None, float] = (None, time.monotonic())
        count = 0
        while not self.stopped.wait(self.interval):
            count += 1
            try:
                self.store.set(f"annot/beat/{self.rank}", str(count))
                beat = self.store.get(key) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the job is ending; nothing left to watch
                return
            now = time.monotonic()
            if beat == _DONE.encode():
                return
            if beat != last[0]:
                last = (beat, now)
            elif now - last[1] >= self.timeout / 2:  # named before the collectives give up
                self._report(watched, now - last[1])
                return

    def _report(self, rank: int, silent: float) -> None:
        try:
            who = self.store.get(f"annot/who/{rank}").decode()
        except Exception:  # noqa: BLE001
            who = "unknown host"
        print(f"annot: rank {self.rank}: rank {rank} ({who}) has not answered for {silent:.0f} s: "
              "it is stopped or hung; collectives waiting on it fail when the process-group "
              f"timeout ({self.timeout:g} s) passes", file=sys.stderr, flush=True)
