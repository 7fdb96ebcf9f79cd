"""Putting a saved checkpoint's files into a folder the user owns (docs/design.md, pitfall 18).

A save stages its files in a hidden folder inside the target (`staging`), so every later
rename stays on one filesystem and is atomic. `commit_weights` then moves them in, in an
order where a reader (`annot.load`, transformers) finds the old checkpoint or the new one
after any single step: a kill at any instant leaves one of the two loadable.

- The commit point is one ``os.replace``: the new ``model.safetensors`` (when no index is
  there) or the new index. A reader prefers the index, so a new single file goes in while
  the old index still hides it, and the old index is removed after.
- New shards whose names an old checkpoint uses cannot be renamed over while the old index
  points at them; an interim index naming the staged copies becomes the commit point, the
  shards are then linked to their final names, and the final index replaces the interim one.
- Only files this module names (`weight_files`, `CONFIG_FILES`) are replaced or removed;
  anything else in the folder stays as it was. What a killed save left behind (hidden
  ``.annot-tmp-*`` entries) is removed by the next commit, once nothing refers to it.

`reached` is called with a label before each step that changes the folder; tests replace
it to stop a save exactly there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from annot.checkpoint_io.formats import FileNames

__all__ = ["CONFIG_FILES", "TMP_PREFIX", "commit_weights", "fsync_path", "reached", "staging",
           "weight_files"]

TMP_PREFIX = ".annot-tmp-"
CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")


def reached(label: str) -> None:
    """A step of the commit is about to run (a no-op; tests put a kill here)."""


def staging(folder: Path) -> Path:
    """A new, empty hidden folder inside ``folder`` (created) for a save's files."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir()
    return path


def weight_files(folder: Path, files: FileNames) -> list[Path]:
    """The files of the checkpoint kind ``files`` names (a full model, a PEFT adapter, a
    diffusers component) that are in ``folder`` now: what a new save of that kind
    replaces."""
    pattern = files.pattern()
    return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name) and not p.is_dir())


def fsync_path(path: Path) -> None:
    """Flush a file's, or a folder's, contents to disk (a folder opened read-only can be
    fsynced on Linux and macOS: that makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(source: Path, target: Path) -> None:
    reached(f"replace {target.name}")
    os.replace(source, target)


def commit_weights(folder: Path, staged: Path, files: FileNames) -> None:
    """Move the files in ``staged`` (weights, an index when sharded, configs) into
    ``folder`` in the order described in the module docstring, then remove the files of
    the old checkpoint of this kind that the new one does not have, and every leftover
    staging entry. ``files`` names this kind's files (``model.safetensors``, ...)."""
    single, index = files.single, files.index
    old = {p.name for p in weight_files(folder, files)}
    names = {p.name for p in staged.iterdir()}
    configs = [n for n in CONFIG_FILES if n in names]
    for name in configs:
        fsync_path(staged / name)
    if index is not None and index in names:
        _commit_shards(folder, staged, index, old)
    else:
        _replace(staged / single, folder / single)
        if index is not None and index in old:  # the old index still wins over the new single file: drop it now
            reached(f"remove {index}")
            (folder / index).unlink()
    for name in configs:  # beside the new weights: a reader may see new weights, old config
        _replace(staged / name, folder / name)
    fsync_path(folder)
    for name in sorted(old - names):
        if not (folder / name).exists():
            continue  # the old index, already removed above
        reached(f"remove {name}")
        (folder / name).unlink(missing_ok=True)
    _remove_leftovers(folder)
    fsync_path(folder)


def _commit_shards(folder: Path, staged: Path, index: str, old: set[str]) -> None:
    weight_map = json.loads((staged / index).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    if old & set(shards):  # the old index refers to names the new shards take
        interim = staged / f"interim-{index}"
        interim.write_text(json.dumps({"weight_map": {
            key: f"{staged.name}/{shard}" for key, shard in weight_map.items()}}))
        fsync_path(interim)
        _replace(interim, folder / index)  # commit point: the staged shards are the checkpoint
        for shard in shards:  # a second name for each, so the interim index stays valid
            link = staged / f"link-{shard}"
            reached(f"link {shard}")
            os.link(staged / shard, link)
            _replace(link, folder / shard)
    else:
        for shard in shards:  # nothing refers to these names yet
            _replace(staged / shard, folder / shard)
    fsync_path(folder)
    _replace(staged / index, folder / index)  # commit point (or the end of the interim)


def _remove_leftovers(folder: Path) -> None:
    """Remove staging folders and files of this and of killed saves (hidden, ours)."""
    for path in folder.iterdir():
        if path.name.startswith(TMP_PREFIX):
            reached(f"clean {path.name}")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
