"""Atomic commit of a checkpoint folder written by one or many ranks.

A save writes into a staging folder beside its final place (``.NAME.partial``), which
only annot writes; its first file (``SAVING.json``, rank 0) says what the save will
write. When every rank has written and synced its files (a barrier), rank 0 writes the
commit marker ``COMMITTED`` last (a JSON list of every file and its size, written to a
temporary name, synced, renamed), then renames the staging folder to its final name and
syncs the parent. A kill at any point therefore leaves either the previous state or
the new one complete; a leftover staging folder is detectably incomplete, and
`require_committed` names what it lacks (docs/design.md, pitfall 18).

The marker is also what allows reading a folder's torch distributed checkpoint
metadata (a pickle, pitfall 17): annot reads it for folders it committed itself.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from annot.checkpoint_io.weights_commit import fsync_path
from annot.errors import CheckpointError
from annot.process_group import barrier, rank_and_world

__all__ = [
    "MARKER",
    "PLAN",
    "begin",
    "commit",
    "is_committed",
    "require_committed",
    "staging_path",
    "write_json",
]

MARKER = "COMMITTED"
PLAN = "SAVING.json"
_PARTIAL = ".partial"


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` durably: a temporary name, synced, renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def staging_path(final: Path) -> Path:
    """Where a save of ``final`` is written before its commit (the same on every rank)."""
    return final.parent / f".{final.name}{_PARTIAL}"


def begin(final: str | os.PathLike[str], expected: dict[str, Any]) -> Path:
    """Start a save of ``final``: rank 0 clears a leftover staging folder and creates a
    fresh one holding ``PLAN`` (``expected``: what the save will write, for messages
    about an incomplete one). Collective; returns the staging folder."""
    staging = staging_path(Path(final))
    if rank_and_world()[0] == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write_json(staging / PLAN, expected)
    barrier()
    return staging


def commit(staging: Path, final: Path, info: dict[str, Any] | None = None) -> Path:
    """Finish a save every rank has written into ``staging`` (each having synced its
    files): after a barrier rank 0 writes the marker, renames ``staging`` to ``final``
    (an existing ``final`` is replaced only once the new one is in place) and syncs the
    parent folder. Collective; returns ``final``."""
    barrier()
    if rank_and_world()[0] == 0:
        files = {p.relative_to(staging).as_posix(): p.stat().st_size
                 for p in sorted(staging.rglob("*")) if p.is_file()}
        write_json(staging / MARKER, {"files": files, **(info or {})})
        fsync_path(staging)
        if final.exists():
            old = final.parent / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
        fsync_path(final.parent)
    barrier()
    return final


def is_committed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder annot committed (its marker present)."""
    return (Path(path) / MARKER).is_file()


def require_committed(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The commit marker of ``path``, after checking that every file it lists is there
    with its size; otherwise `CheckpointError` naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path} is incomplete: {_what_is_missing(path)}")
    try:
        record = json.loads(marker.read_text())
        files = dict(record["files"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{marker}: not a commit marker written by annot ({exc})") from None
    bad = [f"{name} ({'absent' if not (path / name).is_file() else 'wrong size'})"
           for name, size in files.items()
           if not (path / name).is_file() or (path / name).stat().st_size != size]
    if bad:
        raise CheckpointError(f"{path} was committed but files changed since: {', '.join(bad[:10])}")
    return record


def _what_is_missing(path: Path) -> str:
    """Why a folder without a marker is incomplete, naming the files that never came."""
    parts = [f"no commit marker {MARKER} (the save did not finish)"]
    plan = path / PLAN
    if plan.is_file():
        try:
            expected: Iterable[str] = json.loads(plan.read_text()).get("files", [])
        except (json.JSONDecodeError, AttributeError):
            expected = []
        absent = [name for name in expected if not (path / name).exists()]
        if absent:
            shown = ", ".join(absent[:10]) + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
            parts.append(f"missing {shown}")
    else:
        parts.append(f"no {PLAN} either: not a folder annot was saving into")
    if path.name.startswith(".") and path.name.endswith(_PARTIAL):
        parts.append("load the last committed checkpoint instead (pass its parent folder "
                     "to pick the newest complete one)")
    return "; ".join(parts)
