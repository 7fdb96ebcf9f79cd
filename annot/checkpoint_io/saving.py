"""`save`: a (possibly sharded) model to safetensors shards in a checkpoint format's
layout (`annot.checkpoint_io.formats`: annot's own and transformers' names, diffusers',
PEFT's adapter files or a merged base model, as `annot.formats` describes them).

A save is a list of `Entry` (a name, the full shape and dtype, and how to fetch the whole
tensor). On several ranks that all see the folder, each rank writes the rows it holds
straight into the files (`annot.checkpoint_io.shared_save`: no gather, the ranks' writes
in parallel); what has no plain range per rank (a tensor-parallel column block, an
engine's flat shard, a PEFT merge) is gathered to rank 0, which writes it. Otherwise
(one rank, or ranks on separate filesystems) tensors are fetched one at a time (a DTensor's ``full_tensor()``, or the
engine's gather for a flat-sharded parameter) and rank 0 streams each straight into its
file on a writer thread, so no rank ever holds more than two full tensors (`IN_FLIGHT`:
one being written while the next is gathered; FSDP1 also one unit while it gathers). A
save that fails leaves nothing half-written where the checkpoint should be.

The files are staged in a hidden folder inside ``directory`` and moved in by
`annot.checkpoint_io.weights_commit`: only the checkpoint's own files (weights, index, configs)
are replaced, anything else in the folder is left as it was, and a kill at any instant
leaves the old or the new checkpoint loadable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from annot._progress import Progress
from annot.checkpoint_io.entries import Entry
from annot.checkpoint_io.formats import PLAIN, CheckpointFormat, FileNames
from annot.checkpoint_io.loading import state_names
from annot.checkpoint_io.safetensors_file import SafetensorsWriter
from annot.checkpoint_io.shared_save import shared_folder, write_shared
from annot.checkpoint_io.weights_commit import commit_weights, fsync_path, staging, weight_files
from annot.errors import CheckpointError
from annot.meta.layout import WHOLE, ShardLayout, local
from annot.process_group import barrier, rank_and_world

__all__ = ["DEFAULT_SHARD_BYTES", "save"]

DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def save(model: nn.Module, directory: str | os.PathLike[str], *,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None,
         overwrite: bool = False, layout: ShardLayout = WHOLE,
         format: CheckpointFormat = PLAIN) -> list[Path]:
    """Write ``model``'s state as ``format`` lays it out (which tensors under which names,
    `CheckpointFormat.entries`; a tied parameter once) to ``directory``: one file
    (``model.safetensors`` in annot's own format) or, above ``max_shard_bytes``, shards
    with an index, and what the format keeps beside them (a config). ``dtype`` casts
    floating tensors on the way out. Every rank must call it (collective); every rank
    writes the rows it holds when all see the folder, else rank 0 writes what is
    gathered to it. Rank 0 commits. Returns the files written. ``layout`` is where an
    engine that shards flattened parameters keeps them (`annot.save` asks the engines
    and chooses the format).
    """
    directory = Path(directory)
    files = format.files
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} is a file; annot.save writes a folder")
    existing = weight_files(directory, files) if directory.is_dir() else []
    if existing and not overwrite:
        raise CheckpointError(f"{directory} already holds a checkpoint ({existing[0].name}): pass "
                              "overwrite=True to replace it (other files in the folder are kept)")
    # Every rank has looked at the directory before rank 0 writes it: with whole
    # parameters no gather holds rank 0 back, and another rank would find the new save.
    barrier()

    def out_dtype(entry: Entry) -> torch.dtype:
        return dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype

    entries = format.entries(model, _tensors(model, layout), layout)
    bare = layout.bare_model(model)
    return _write(directory, entries, out_dtype,
                  max_shard_bytes=max_shard_bytes if files.index is not None else None,
                  files=files, extra=lambda staged: format.write_beside(bare, staged))


def _tensors(model: nn.Module, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """The model's state by bare name, a tied tensor once under its first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state_names(model, layout).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    if any(local(t).is_meta for t in out.values()):
        raise CheckpointError("the model still has meta tensors: materialize or load it before saving")
    return out


IN_FLIGHT = 2  # whole tensors alive on a rank at once during a save: one written, one gathered


def _write(directory: Path, entries: list[Entry], out_dtype: Callable[[Entry], torch.dtype], *,
           max_shard_bytes: int | None, files: FileNames,
           extra: Callable[[Path], None]) -> list[Path]:
    """Stream ``entries`` into safetensors files staged inside ``directory`` (rank 0), add
    what ``extra(staged)`` writes (configs), then commit them (`commit_weights`).

    Every rank gathers on this thread, in entry order (the gathers are collective); rank
    0 hands each whole tensor to one writer thread, which casts and writes it while the
    next one is gathered (file writes and gathers release the GIL). Before each gather
    the main thread waits until at most ``IN_FLIGHT - 1`` tensors are still queued or
    being written, so no rank holds more than `IN_FLIGHT` whole tensors at once (plus,
    while one is cast to ``out_dtype``, its converted copy). A file is closed (and
    fsynced) on the writer thread too, behind the next file's gathers."""
    rank, world = rank_and_world()
    shards = _split(entries, max_shard_bytes, out_dtype)
    names = [files.single if len(shards) == 1 else files.shard(i, len(shards)) for i in range(len(shards))]
    created = not directory.exists()
    staged = staging(directory) if rank == 0 else None
    pool: ThreadPoolExecutor | None = None
    pending: deque[Future[None]] = deque()  # tensor writes not yet done
    closing: list[Future[None]] = []
    writers: list[SafetensorsWriter] = []
    try:
        # Several ranks on one filesystem: each writes its own rows, no gather (issue #32).
        shared = shared_folder(staged) if world > 1 else None
        if shared is not None:
            write_shared(shared, names, shards, out_dtype)
        else:
            pool = ThreadPoolExecutor(1, thread_name_prefix="annot-save") if staged is not None else None
            _write_gathered(staged, names, shards, out_dtype, pool, pending, closing, writers)
        for future in [*pending, *closing]:
            future.result()
        if staged is not None:
            _write_index(staged, shards, names, out_dtype, files)
            extra(staged)
            commit_weights(directory, staged, files)
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # no write runs on while we clean up
        for writer in writers:
            writer.abort()
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
            if created:  # a folder this save made, now empty again
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    barrier()
    return [directory / name for name in names]


def _write_gathered(staged: Path | None, names: list[str], shards: list[list[Entry]],
                    out_dtype: Callable[[Entry], torch.dtype], pool: ThreadPoolExecutor | None,
                    pending: deque[Future[None]], closing: list[Future[None]],
                    writers: list[SafetensorsWriter]) -> None:
    """Every rank gathers each tensor in turn; rank 0 (``staged`` given) queues its write
    on ``pool`` (see `_write`)."""
    with Progress("saving", sum(len(shard) for shard in shards)) as progress:
        for name, shard in zip(names, shards, strict=True):
            writer = None
            if staged is not None:
                writer = SafetensorsWriter(staged / name, [(e.name, e.shape, out_dtype(e)) for e in shard])
                writers.append(writer)
            for entry in shard:
                while len(pending) >= IN_FLIGHT:  # the gather below makes one more
                    pending.popleft().result()
                full = [entry.fetch()]  # collective for sharded tensors: every rank calls
                if writer is not None and pool is not None:
                    pending.append(pool.submit(_cast_and_write, writer, entry.name, full,
                                               out_dtype(entry)))
                del full  # now only the writer thread holds it
                progress.advance()
            if writer is not None and pool is not None:
                closing.append(pool.submit(writer.close))


def _cast_and_write(writer: SafetensorsWriter, name: str, box: list[torch.Tensor],
                    dtype: torch.dtype) -> None:
    """Write the tensor in ``box``, taken out so that it is freed when this returns: the
    executor keeps a task's arguments a moment after its future is done, and the main
    thread counts a tensor as gone once its future is."""
    full = box.pop()
    writer.write(name, full.to(dtype))


def _nbytes(entry: Entry, out_dtype: Callable[[Entry], torch.dtype]) -> int:
    return math.prod(entry.shape) * out_dtype(entry).itemsize


def _split(entries: list[Entry], limit: int | None,
           out_dtype: Callable[[Entry], torch.dtype]) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry, out_dtype)
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _write_index(staged: Path, shards: list[list[Entry]], names: list[str],
                 out_dtype: Callable[[Entry], torch.dtype], files: FileNames) -> None:
    if len(shards) == 1 or files.index is None:
        return
    total = sum(_nbytes(e, out_dtype) for shard in shards for e in shard)
    weight_map = {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard}
    (staged / files.index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    fsync_path(staged / files.index)
