"""Every rank writes the bytes it owns into the save's files: no gather, writes in parallel.

A safetensors file stores each tensor's elements in row-major order, so the rows an
FSDP2 shard (a dim-0 block of a DTensor) holds are one contiguous byte range of the
file, as on load. Once rank 0 has created each staged file with its header and its full
length, each rank writes its own rows at their offsets (positioned writes from the
tensor's own memory), asks Linux to start writing them to disk at once, and fsyncs each
file it wrote once; rank 0 then writes the index and commits as for any save
(`annot.checkpoint_io.weights_commit`). A tensor this rank does not own a plain range
of (a tensor-parallel column block, an engine's flat shard, a PEFT merge) is gathered
as before and written by rank 0.

Owner of a range: for a DTensor, the ranks at coordinate 0 of every replicated mesh
dimension (so HSDP's replicas write once); for a tensor every rank holds whole, rank 0
(whose value a save has always written).

It needs every rank to see the folder rank 0 stages into (one filesystem, as a
checkpoint on shared storage or one node): `shared_folder` checks that with a token
file and says no otherwise, and the save then gathers everything to rank 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from annot.checkpoint_io.entries import Entry
from annot.checkpoint_io.safetensors_file import RangeWriter, SafetensorsWriter
from annot.errors import CheckpointError
from annot.meta.layout import dtensor_block

__all__ = ["owned_pieces", "shared_folder", "write_shared"]

_TOKEN = "rank0-token"


def shared_folder(staged: Path | None) -> Path | None:
    """The staging folder rank 0 made (``staged`` there, ``None`` elsewhere) when every
    rank sees it, else ``None`` on every rank (collective)."""
    rank = dist.get_rank()
    token = os.urandom(8).hex() if rank == 0 else None
    if staged is not None and token is not None:
        (staged / _TOKEN).write_text(token)
    box: list[object] = [str(staged) if staged is not None else None, token]
    dist.broadcast_object_list(box, src=0)
    folder, expected = Path(str(box[0])), box[1]
    try:
        seen = (folder / _TOKEN).read_text() == expected
    except OSError:
        seen = False
    answers: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, seen)
    if rank == 0 and staged is not None:
        (staged / _TOKEN).unlink()
    return folder if all(answers) else None


def owned_pieces(entry: Entry, rank: int) -> list[tuple[int, torch.Tensor]] | None:
    """What this rank writes of ``entry``: ``(first element, tensor)`` pairs ([] for
    nothing); ``None`` when the entry has no plain range per rank and must be gathered."""
    tensor = entry.source
    if tensor is None:
        return None
    if entry.layout is not None and id(tensor) in entry.layout.parts:
        return None  # an engine's flat shard: its ranges are the engine's (gathered)
    if not isinstance(tensor, DTensor):
        # Whole on every rank, and rank 0's is what a save has always written: a buffer
        # no engine keeps in step (FSDP2's batch-norm statistics) may differ per rank.
        return [(0, tensor.detach())] if rank == 0 else []
    placements = tensor.placements

    if not all(type(p) is Shard or isinstance(p, (Replicate, _StridedShard)) for p in placements):
        return None  # partial sums: the gather resolves them
    # Strided shards (FSDP2 over expert- or tensor-parallel rows) pass where this rank's
    # part is still one run of whole rows (`dtensor_block` raises otherwise): expert
    # stacks, the largest tensors of an MoE, are then never gathered whole.
    try:
        block = dtensor_block(tensor)
    except ValueError:
        return None
    full = tuple(entry.shape)
    if block is None or (full and not block.rows_only(full)):
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(isinstance(p, Replicate) and c for p, c in zip(placements, coordinate, strict=True)):
        return []  # another replica writes these rows
    first = block.start[0] * math.prod(full[1:]) if full else 0
    return [(first, tensor.to_local().detach())]


def write_shared(staged: Path, names: list[str], shards: list[list[Entry]],
                 out_dtype: Callable[[Entry], torch.dtype]) -> None:
    """Write ``shards`` (entries by file, ``names`` the files) into ``staged``, every rank
    its own pieces (collective; `owned_pieces`), gathering the rest to rank 0. Every rank
    raises if any rank failed."""
    rank = dist.get_rank()
    error: str | None = None
    try:
        if rank == 0:  # headers and full lengths first: the other ranks open existing files
            for name, shard in zip(names, shards, strict=True):
                SafetensorsWriter.create_empty(staged / name, [(e.name, e.shape, out_dtype(e)) for e in shard])
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"rank 0: {exc!r}"
    _raise_any(error)
    for name, shard in zip(names, shards, strict=True):
        offsets = SafetensorsWriter.data_offsets([(e.name, e.shape, out_dtype(e)) for e in shard])
        writer = None
        for entry in shard:
            pieces = owned_pieces(entry, rank)
            if pieces is None:  # collective: every rank fetches (even after a failure), rank 0 writes
                fetched = entry.fetch()
                pieces = [(0, fetched)] if rank == 0 else []
                del fetched
            if error is not None:
                continue  # keep taking part in the gathers; report at the end
            try:
                for first, tensor in pieces:
                    if writer is None:
                        writer = RangeWriter(staged / name)
                    dtype = out_dtype(entry)
                    data = tensor.to(dtype=dtype)  # any device: the writer copies it in pieces
                    writer.write_at(offsets[entry.name] + first * dtype.itemsize, data)
                    del data
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = f"rank {rank}: {entry.name}: {exc!r}"
            del pieces
        if writer is not None:
            try:
                writer.close()  # one fsync per file a rank wrote into
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = error or f"rank {rank}: {name}: {exc!r}"
    _raise_any(error)


def _raise_any(error: str | None) -> None:
    """Raise on every rank when any rank failed, naming each failure."""
    errors: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [str(e) for e in errors if e is not None]
    if failed:
        raise CheckpointError("saving failed: " + "; ".join(failed))
