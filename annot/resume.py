"""`resume_state`: continue a run from the newest training state that loads, after a
crash, a preemption or a torchrun restart.

`annot.load_state` of a folder takes its newest committed save and fails if that one is
damaged: under ``torchrun --max-restarts`` the job then dies again on every restart.
Here each committed save under the folder is tried from the newest: first its commit
record (every file it lists present, with its size: a truncated shard or a removed rank
file fails here, the same on every rank), then the load itself (a read error). A save
that fails is named in the log with the reason and the one before it is tried; all
ranks agree on each outcome (one collective), so they load the same save. No loadable
save: the run starts fresh (``None``), which the log says too.

The restart count torchrun passes (``TORCHELASTIC_RESTART_COUNT``) is logged with the
steps the interrupted attempt trained past the save it resumes from, read from the
progress record `annot.Interruptions` keeps (`PROGRESS_FILE`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from annot.checkpoint_io import commit
from annot.engines.base import Trainable
from annot.errors import CheckpointError
from annot.process_group import any_rank, rank_and_world
from annot.training_state import ResumedState, committed_states, load_state

__all__ = ["PROGRESS_FILE", "read_progress", "restart_count", "resume_state", "write_progress"]

#: The last step boundary a run passed, beside its saves (written by rank 0).
PROGRESS_FILE = "progress.json"
_ELSEWHERE = "another rank could not load it"
_log = logging.getLogger("annot")


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (0 on the first attempt or
    without torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def write_progress(directory: str | os.PathLike[str], step: int) -> None:
    """Record that the run passed step boundary ``step`` (rank 0 only; atomic replace, not
    synced: a lost record only makes the restart's report of lost steps vaguer)."""
    if rank_and_world()[0] != 0:
        return
    path = Path(directory) / PROGRESS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": int(step), "attempt": restart_count()}))
    os.replace(tmp, path)


def read_progress(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The progress record under ``directory`` (``None`` if none or unreadable)."""
    try:
        record = json.loads((Path(directory) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def resume_state(directory: str | os.PathLike[str], trainable: Trainable, *, scheduler: Any = None,
                 data: Any = None, strict: bool = True) -> ResumedState | None:
    """Load the newest training state under ``directory`` that loads (see the module
    docstring) into ``trainable`` (and ``scheduler``, ``data``, as `annot.load_state`);
    ``None`` when there is none, so the run starts from step 0. Collective.

    A newer save that fails its check or its load is skipped with a warning naming it
    and why; the restart count and the steps lost since the save resumed from are
    logged on rank 0."""
    directory = Path(directory)
    progress = read_progress(directory)
    restarts = restart_count()
    for path in reversed(committed_states(directory)):
        failure = _try_load(path, trainable, scheduler=scheduler, data=data, strict=strict)
        if isinstance(failure, str):
            if rank_and_world()[0] == 0 or not failure.startswith(_ELSEWHERE):  # each reason once
                _log.warning("%s: not loadable (%s); trying the save before it", path, failure)
            continue
        _report(directory, failure, progress, restarts)
        return failure
    if rank_and_world()[0] == 0:
        _log.warning("%s: no loadable training state; starting from step 0%s", directory,
                     f" (restart {restarts})" if restarts else "")
    return None


def _try_load(path: Path, trainable: Trainable, **options: Any) -> ResumedState | str:
    """The state loaded from ``path``, or why it could not be (every rank gets the same
    answer: a failure on one rank is a failure on all)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    reason = ""
    resumed: ResumedState | None = None
    try:
        commit.require_committed(path)  # sizes from the commit record: the same on every rank
        resumed = load_state(path, trainable, **options)
    except (CheckpointError, CheckpointException, OSError, ValueError, RuntimeError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
    if any_rank(bool(reason)):
        return reason or _ELSEWHERE
    assert resumed is not None
    return resumed


def _report(directory: Path, resumed: ResumedState, progress: dict[str, Any] | None, restarts: int) -> None:
    if not rank_and_world()[0] == 0:
        return
    lost = ""
    if progress is not None and progress["step"] > resumed.step:
        lost = f"; the interrupted attempt had reached step {progress['step']}: " \
               f"{progress['step'] - resumed.step} step(s) to train again"
    _log.warning("%s: resuming at step %d from %s%s%s", directory, resumed.step, resumed.path.name,
                 f" (restart {restarts})" if restarts else "", lost)
