"""A collective that timed out, named: which ranks stopped answering, the step each
rank passed last, the collective this rank waited in, and torch's flight-recorder trace
of it on disk.

A rank that is stopped or hung (SIGSTOP, a dead peer, a rank that took another branch)
leaves the others waiting in a collective until the process group's timeout, and the
error then says "Timed out waiting 3000ms for recv" and nothing else. Here the waiting
rank reads the heartbeat's record in the store (`annot.process_group`): the ranks whose
beat has stopped, and the step boundary each rank published last; and the collective it
waited in from torch's flight recorder (on by default under `annot.init_distributed`),
whose whole trace it writes to ``FOLDER/rank_<rank>`` (`dump_flight_recorder`; the
files ``torchfrtrace FOLDER`` reads for NCCL; gloo's traces in torch 2.13 carry an empty
process-group table, on which ``torchfrtrace`` fails).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from annot.process_group import collective_timeout, heartbeat_snapshot, rank_and_world

__all__ = ["dump_flight_recorder", "hang_report", "is_collective_failure"]

#: Words of the errors torch's backends raise when a collective times out or its peer is
#: gone (gloo: "Timed out waiting ... for recv", "Connection closed by peer"; NCCL's
#: watchdog: "Watchdog caught collective operation timeout").
_FAILURE_WORDS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost its peer (a distributed
    backend's error saying so)."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _FAILURE_WORDS)


def dump_flight_recorder(folder: str | os.PathLike[str]) -> Path | None:
    """Write this rank's flight-recorder trace (torch's pickle, what ``torchfrtrace``
    reads) to ``folder/rank_<rank>``; ``None`` when torch records nothing (the recorder
    is off, or this torch has none)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]
        data = _dump_fr_trace()
    except (ImportError, RuntimeError):
        return None
    if not data:
        return None
    rank = rank_and_world()[0]
    path = Path(folder) / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _last_collective() -> str | None:
    """The newest entry of this rank's flight recorder, in words."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]
        entries = json.loads(_dump_fr_trace_json()).get("entries", [])
    except (ImportError, RuntimeError, ValueError):
        return None
    if not entries:
        return None
    last: dict[str, Any] = entries[-1]
    group = last.get("process_group") or ["?", "?"]
    return (f"{last.get('profiling_name', 'a collective')} (collective {last.get('collective_seq_id', '?')} "
            f"of process group {group[1] if len(group) > 1 else group[0]})")


def hang_report(exc: BaseException, folder: str | os.PathLike[str] | None) -> str:
    """What this rank knows of the collective ``exc`` ended: the ranks whose heartbeat
    stopped (the store read twice, a beat interval and a half apart), each rank's last
    step boundary, the collective this rank waited in, and where its trace was written
    (``folder``; none written for ``None``). Meant for a message before exiting."""
    rank = rank_and_world()[0]
    lines = [f"annot: rank {rank}: a collective failed after the {collective_timeout():g} s bound "
             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"]
    silent = _silent_ranks()
    if silent is not None:
        if silent:
            # Published with the heartbeat's beat: up to a beat (a second at most) behind.
            lines += [f"  rank {r} ({who}) stopped answering; last step boundary it reported "
                      f"(at most a second old): {step or 'none yet'}" for r, (step, who) in sorted(silent.items())]
        else:
            lines.append("  every rank's heartbeat still moves: a rank is waiting in another collective "
                         "(a branch only some ranks took?)")
    waited = _last_collective()
    if waited is not None:
        lines.append(f"  rank {rank} waited in {waited}")
    if folder is not None:
        written = dump_flight_recorder(folder)
        if written is not None:
            lines.append(f"  flight-recorder trace: {written} (torch's pickle: this rank's last collectives "
                         "with their sizes and Python stacks)")
    return "\n".join(lines)


def _silent_ranks() -> dict[int, tuple[str | None, str]] | None:
    """Ranks whose beat did not move between two reads: rank -> (last step, host)."""
    try:
        first = heartbeat_snapshot()
        if first is None:
            return None
        time.sleep(min(1.0, collective_timeout() / 10) * 1.5)
        second = heartbeat_snapshot()
    except (RuntimeError, OSError):  # the store itself is gone with the job
        return None
    assert second is not None
    return {r: (second[r][1], second[r][2]) for r in first
            if first[r][0] == second[r][0] and second[r][0] != "done"}
