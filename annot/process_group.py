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
asking it to stop; it defaults to 30 s). `set_collective_timeout` shortens the bound once
the run is past its slow start (`annot.Interruptions` does it after the first step), for
the heartbeat too; `note_step` hands the heartbeat the step boundary this rank passed
last, which it publishes with its beat (`annot.collective_hangs` reads them when a
collective times out).

Under torchrun's restarts (``--max-restarts``) the agent keeps one key-value store for
every attempt, and the keys a process group reads at start (each rank's address) are
still there from the attempt before: a restarted rank read a dead rank's address and
the restart failed ("Connection refused", measured with gloo on torch 2.13). Each
attempt's keys are therefore kept apart (`attempt_store`), and the flight recorder is
on by default (``TORCH_FR_BUFFER_SIZE``; pitfall 69).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from annot.devices import choose_device, distributed_backend, uses_cuda

__all__ = ["DEFAULT_TIMEOUT_S", "FLIGHT_RECORDER_ENTRIES", "any_rank", "attempt_store", "barrier", "collective_timeout",
           "heartbeat_snapshot", "init_distributed", "long_collectives", "note_step", "rank_and_world", "set_collective_timeout"]

DEFAULT_TIMEOUT_S = 600.0  # long enough for a checkpoint save, far below torch's 30 minutes
#: Collectives the flight recorder keeps per process group (TORCH_FR_BUFFER_SIZE) unless
#: the user set it: a few steps' worth, some hundred kilobytes of host memory.
FLIGHT_RECORDER_ENTRIES = 2000
_DONE = "done"
_state: dict[str, Any] = {"timeout": DEFAULT_TIMEOUT_S, "init_timeout": DEFAULT_TIMEOUT_S,
                          "step": None, "heartbeat": None}


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
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    bound = datetime.timedelta(seconds=timeout)
    store = attempt_store(bound)
    if store is not None:
        dist.init_process_group(backend, timeout=bound, device_id=device_id, store=store,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend, timeout=bound, device_id=device_id)
    _state.update(timeout=timeout, init_timeout=timeout, step=None)
    if heartbeat and dist.get_world_size() > 1:
        _state["heartbeat"] = _Heartbeat(timeout)
        _state["heartbeat"].start()
    return chosen


def attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A client of torchrun's agent store whose keys are this restart attempt's own
    (``annot/attempt-N/``), or ``None`` outside torchrun's agent store (plain env:// then)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"annot/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def collective_timeout() -> float:
    """The bound on collectives now (seconds): `init_distributed`'s, or what
    `set_collective_timeout` set since."""
    return float(_state["timeout"])


def set_collective_timeout(seconds: float | None) -> None:
    """Bound the default group's collectives by ``seconds`` from now on (``None``: back to
    `init_distributed`'s bound), the heartbeat's report with them. Not collective: every
    rank sets its own (each must, to stop waiting as soon)."""
    if seconds is not None and seconds <= 0:
        raise ValueError(f"a collective timeout must be positive seconds, got {seconds}")
    value = float(_state["init_timeout"] if seconds is None else seconds)
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=value))
    _state["timeout"] = value
    beat = _state["heartbeat"]
    if beat is not None:
        beat.timeout, beat.interval = value, min(1.0, value / 10)


@contextlib.contextmanager
def long_collectives() -> Iterator[None]:
    """Collectives inside run under `init_distributed`'s bound again, when a shorter one
    was set (a save's barriers wait for the slowest rank's writes, far longer than a
    step's collectives); the shorter bound comes back after."""
    current = float(_state["timeout"])
    if current >= float(_state["init_timeout"]):
        yield
        return
    set_collective_timeout(None)
    try:
        yield
    finally:
        set_collective_timeout(current)


def note_step(step: int) -> None:
    """This rank passed step boundary ``step``: published with its next beat."""
    _state["step"] = int(step)


def heartbeat_snapshot() -> dict[int, tuple[str, str | None, str]] | None:
    """Each rank's (beat counter, last step boundary, host and pid) as the store holds
    them now, or ``None`` without a heartbeat."""
    beat = _state["heartbeat"]
    return beat.snapshot() if beat is not None else None


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (default: every rank). Collective;
    ``flag`` itself without a process group or alone in one. The flag travels as a CPU
    tensor where the group moves them (gloo), else on this rank's CUDA device (NCCL)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    if "gloo" not in str(dist.get_backend(group)):
        value = value.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _store_client(timeout: datetime.timedelta) -> dist.Store:
    """A client of its own of the job's key-value store (this restart attempt's keys under
    torchrun's agent store): for a thread other than the main one, or one-off reads."""
    return attempt_store(timeout) or dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


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
        self.store = _store_client(datetime.timedelta(seconds=timeout))
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
        reported = False
        while not self.stopped.wait(self.interval):
            count += 1
            try:
                self.store.set(f"annot/beat/{self.rank}", str(count))
                if _state["step"] is not None:
                    self.store.set(f"annot/step/{self.rank}", str(_state["step"]))
                beat = self.store.get(key) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the job is ending; nothing left to watch
                return
            now = time.monotonic()
            # Beating goes on whatever it sees (a rank whose beat stops is taken for a
            # stopped one: `annot.collective_hangs`); the watch ends at the first report
            # or when the watched rank leaves.
            if reported or beat == _DONE.encode():
                reported = True
            elif beat != last[0]:
                last = (beat, now)
            elif now - last[1] >= self.timeout / 2:  # named before the collectives give up
                self._report(watched, now - last[1])
                reported = True

    def snapshot(self) -> dict[int, tuple[str, str | None, str]]:
        """Each rank's beat counter, last step boundary and host as the store holds them
        (from the caller's thread: a client of its own)."""
        store = _store_client(datetime.timedelta(seconds=10))
        out = {}
        for rank in range(self.world):
            def read(key: str) -> str | None:
                return store.get(key).decode() if store.check([key]) else None
            out[rank] = (read(f"annot/beat/{rank}") or "", read(f"annot/step/{rank}"),
                         read(f"annot/who/{rank}") or "unknown host")
        return out

    def _report(self, rank: int, silent: float) -> None:
        try:
            who = self.store.get(f"annot/who/{rank}").decode()
        except Exception:  # noqa: BLE001
            who = "unknown host"
        print(f"annot: rank {self.rank}: rank {rank} ({who}) has not answered for {silent:.0f} s: "
              "it is stopped or hung; collectives waiting on it fail when the process-group "
              f"timeout ({self.timeout:g} s) passes", file=sys.stderr, flush=True)
