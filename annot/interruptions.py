"""`Interruptions`: a training loop that survives preemption, crashes and hangs.

    with annot.Interruptions("runs/x", trainer, data=loader) as run:
        for step in range(run.resume(), steps):
            ...                              # forward, backward, step
            run.step_done(step + 1)          # collective: saves and exits 0 when signalled
            if (step + 1) % 100 == 0:
                annot.save_state("runs/x", trainer, step=step + 1, data=loader, keep_last=2)

- **Resume**: `resume` loads the newest state under the folder that loads, falling back
  past damaged ones (`annot.resume.resume_state`), and says how many steps the restart
  costs.
- **Preemption**: the signals (SIGTERM and SIGUSR1 by default: what Slurm and torchrun
  send) are only recorded by the handler. `step_done` agrees on them across the ranks
  (one all-reduce of a flag on a gloo group of its own, so a signal that reached one rank
  is enough, and every rank stops at the same step), finishes a pending asynchronous
  save, saves synchronously and exits 0 (``SystemExit(0)``), so a scheduler's requeue or
  a relaunch resumes. Nothing is saved inside the handler: a save there can deadlock
  (the interrupted code may hold the locks and collectives the save needs; Lightning
  #21406).
- **Hangs**: after the first step the collectives are bounded by ``collective_timeout``
  (`annot.process_group.set_collective_timeout`; saves lift the bound while they run);
  a collective that fails inside the block is reported by `annot.collective_hangs` (the
  silent ranks, the step each passed, the collective this rank waited in, the flight
  recorder's trace written under ``traces``), and the process exits with status 1 at
  once, so torchrun restarts the job instead of it hanging in teardown.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch.distributed as dist

from annot.collective_hangs import hang_report, is_collective_failure
from annot.engines.base import Trainable
from annot.process_group import any_rank, note_step, rank_and_world, set_collective_timeout
from annot.resume import restart_count, resume_state, write_progress
from annot.training_state import finish_pending_saves, save_state

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "DEFAULT_SIGNALS", "HANG_EXIT_STATUS", "Interruptions"]

#: What Slurm sends at the time limit or on preemption (SIGTERM; SIGUSR1 ahead of time
#: with ``--signal=B:USR1@N``) and what torchrun forwards to its workers.
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: The bound on a collective after the first step: far above a healthy step's wait on
#: its slowest rank, far below `annot.init_distributed`'s 600 s (torchtitan uses 100 s).
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
#: The exit status after a collective failed (non-zero: torchrun restarts the workers).
HANG_EXIT_STATUS = 1
_log = logging.getLogger("annot")


class Interruptions:
    """Resume, save on preemption, and end hangs, around a training loop (see the module
    docstring). ``directory``: where the run's states are saved and resumed from.
    ``trainable``, ``data``, ``scheduler``: what `annot.save_state` saves.
    ``signals``: those that ask for a save and an exit. ``collective_timeout``: seconds
    (``None``: leave `annot.init_distributed`'s bound). ``traces``: where the flight
    recorder's traces go on a collective failure (default ``directory/collective-traces/
    attempt-<restart>``). ``exit``: `step_done` raises ``SystemExit(0)`` after the save
    (``False``: it returns ``True`` and the loop ends itself)."""

    def __init__(self, directory: str | os.PathLike[str], trainable: Trainable, *, data: Any = None,
                 scheduler: Any = None, signals: Sequence[int] = DEFAULT_SIGNALS,
                 collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT_S,
                 traces: str | os.PathLike[str] | None = None, exit: bool = True) -> None:
        if not isinstance(trainable, Trainable):
            raise TypeError(f"Interruptions takes the Trainable auto_wrap(..., optimizer=...) returns, "
                            f"not {type(trainable).__name__}")
        if collective_timeout is not None and collective_timeout <= 0:
            raise ValueError(f"collective_timeout must be positive seconds or None, got {collective_timeout}")
        self.directory = Path(directory)
        self.trainable, self.data, self.scheduler = trainable, data, scheduler
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.collective_timeout = collective_timeout
        self.traces = Path(traces) if traces is not None else \
            self.directory / "collective-traces" / f"attempt-{restart_count()}"
        self.exit = exit
        #: The signal this rank received (the first one), if any.
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._group: Any = None
        self._steps_done = 0

    # -- the block -------------------------------------------------------------------------
    def __enter__(self) -> Interruptions:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A gloo group of its own: a CPU flag on any backend, never meeting the
            # training's collectives (or a background save's).
            self._group = dist.new_group(backend="gloo")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if exc is not None and is_collective_failure(exc) and dist.is_initialized():
            traceback.print_exception(exc, file=sys.stderr)  # where it failed, as Python says
            print(hang_report(exc, self.traces), file=sys.stderr, flush=True)
            # Teardown would wait on the peer that is gone (destroying the group, a
            # pending save's collectives): leave now, so torchrun restarts the job.
            os._exit(HANG_EXIT_STATUS)
        if exc is None or isinstance(exc, SystemExit):
            finish_pending_saves()  # the run's last asynchronous save, committed
        if self._steps_done and self.collective_timeout is not None:
            set_collective_timeout(None)  # the bound was the loop's; what follows is not

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the save happens at the next step boundary (module docstring).
        if self.received is None:
            self.received = signal.Signals(signum)

    # -- the loop ----------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest loadable state under the folder; the step to train next (0 when
        there is none). Collective."""
        resumed = resume_state(self.directory, self.trainable, scheduler=self.scheduler, data=self.data)
        return resumed.step if resumed is not None else 0

    def step_done(self, step: int) -> bool:
        """Step boundary ``step`` (the number of steps trained): record it, and if any rank
        was signalled, save the state at ``step`` and exit 0 (or return ``True`` with
        ``exit=False``). Collective: every rank calls it at every step."""
        self._steps_done += 1
        note_step(step)
        write_progress(self.directory, step)
        if self._steps_done == 1 and self.collective_timeout is not None:
            set_collective_timeout(self.collective_timeout)  # past the slow first step
        if not self._anyone_signalled():
            return False
        started = time.perf_counter()
        save_state(self.directory, self.trainable, step=step, data=self.data, scheduler=self.scheduler)
        if rank_and_world()[0] == 0:
            said = self.received.name if self.received is not None else "a signal to another rank"
            _log.warning("%s: %s: saved step %d in %.1f s; exiting 0 to be resumed", self.directory,
                         said, step, time.perf_counter() - started)
        if self.exit:
            raise SystemExit(0)
        return True

    def _anyone_signalled(self) -> bool:
        return any_rank(self.received is not None, group=self._group)
