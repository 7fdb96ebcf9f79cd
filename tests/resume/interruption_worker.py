"""examples/gpt/train.py with one fault injected on torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), for tests/resume/test_interruptions.py.

``ANNOT_FAULT=KIND:STEP:RANK[:SIGNAL]``, STEP counting optimizer steps from 0 on that
attempt (which starts fresh), on rank RANK only:

- ``kill``: SIGKILL itself in step STEP, after backward, before the optimizer step;
- ``kill-in-commit``: SIGKILL itself while the save of step STEP commits, after its own
  files are written, before the barrier that precedes the commit marker;
- ``signal``: send itself SIGNAL (a name, ``SIGUSR1``) in step STEP;
- ``signal-after-save``: send itself SIGNAL as soon as the save of step STEP returns
  (with ``--async-save``: while that save is still being written);
- ``stop``: SIGSTOP itself in step STEP (it never continues: a hang).

The other arguments are the example's.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import annot
from annot.checkpoint_io import commit
from annot.engines.base import Trainable
from examples.gpt import train


def _inject(kind: str, step: int, rank: int, signame: str | None) -> None:
    import torch.distributed as dist

    def mine() -> bool:
        return dist.is_initialized() and dist.get_rank() == rank

    steps = {"count": 0}
    original_step = Trainable.step

    def step_with_fault(self: Trainable, *args: Any, **kwargs: Any) -> Any:
        here = steps["count"]
        steps["count"] += 1
        if here == step and mine():
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "signal":
                os.kill(os.getpid(), signal.Signals[signame or "SIGUSR1"])
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        return original_step(self, *args, **kwargs)

    Trainable.step = step_with_fault  # type: ignore[method-assign]

    if kind == "kill-in-commit":
        original_commit = commit.commit

        def commit_with_fault(staging: Any, final: Any, info: Any = None) -> Any:
            if (info or {}).get("step") == step and mine():
                os.kill(os.getpid(), signal.SIGKILL)
            return original_commit(staging, final, info)

        commit.commit = commit_with_fault  # type: ignore[assignment]

    if kind == "signal-after-save":
        original_save = annot.save_state

        def save_with_fault(*args: Any, **kwargs: Any) -> Any:
            result = original_save(*args, **kwargs)
            if kwargs.get("step") == step and mine():
                os.kill(os.getpid(), signal.Signals[signame or "SIGUSR1"])
            return result

        annot.save_state = save_with_fault  # type: ignore[attr-defined]


if __name__ == "__main__":
    fault = os.environ.get("ANNOT_FAULT", "")
    if fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kind, at, rank, *name = fault.split(":")
        _inject(kind, int(at), int(rank), name[0] if name else None)
    train.main(sys.argv[1:])
