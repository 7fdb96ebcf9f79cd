"""`save`: a (possibly sharded) model to HuggingFace-compatible safetensors shards.

Tensors are gathered one at a time (a sharded parameter's ``full_tensor()``) and rank 0
streams each straight into its file, so no rank ever holds more than one full tensor.
The files go to a temporary directory that is renamed into place at the end: a save that
fails leaves nothing half-written where the checkpoint should be.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from annot._progress import Progress
from annot.checkpoint_io.loading import INDEX, SINGLE, state_names
from annot.checkpoint_io.safetensors_file import SafetensorsWriter
from annot.errors import CheckpointError
from annot.meta.layout import WHOLE, ShardLayout

__all__ = ["save"]

DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def save(model: nn.Module, directory: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
         dtype: torch.dtype | None = None, overwrite: bool = False,
         layout: ShardLayout = WHOLE) -> list[Path]:
    """Write ``model``'s state (parameters and persistent buffers; a tied parameter once,
    under its first name) to ``directory`` as ``model.safetensors`` or, above
    ``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json``; a HuggingFace ``config`` is saved beside them.
    ``dtype`` casts floating tensors on the way out. Every rank must call it (sharded
    tensors are gathered collectively); rank 0 writes. Returns the files written.
    """
    directory = Path(directory)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise CheckpointError(f"{directory} exists and is not empty: pass overwrite=True to replace it")
    tensors = _unique(model, layout)
    if any(_local(t).is_meta for t in tensors.values()):
        raise CheckpointError("the model still has meta tensors: materialize or load it before saving")
    if layout.flat:
        raise CheckpointError(
            "annot.save writes plain and FSDP2 models; for FSDP1 or DeepSpeed ZeRO-3 use the "
            "engine's own checkpointing (FSDP1 full state dict, DeepSpeed save_checkpoint)")

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    shards = _split(tensors, max_shard_bytes, out_dtype)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    files = [tmp / _shard_name(i, len(shards)) for i in range(len(shards))]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        progress = Progress("saving", len(tensors))
        for file, shard in zip(files, shards, strict=True):
            writer = None
            if rank == 0:
                writer = SafetensorsWriter(file, [(n, tuple(tensors[n].shape), out_dtype(tensors[n])) for n in shard])
            for name in shard:
                full = _full(tensors[name])  # collective for sharded tensors: every rank calls
                if writer is not None:
                    writer.write(name, full.to(out_dtype(full)))
                progress.advance()
            if writer is not None:
                writer.close()
        progress.__exit__()
        if rank == 0:
            _write_index(tmp, shards, files, tensors, out_dtype)
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(tmp)
            _replace(tmp, directory)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return [directory / f.name for f in files]


def _unique(model: nn.Module, layout: ShardLayout) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state_names(model, layout).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _split(tensors: dict[str, torch.Tensor], limit: int, out_dtype) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * torch.empty((), dtype=out_dtype(t)).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_index(tmp: Path, shards: list[list[str]], files: list[Path], tensors, out_dtype) -> None:
    if len(shards) == 1:
        return
    total = sum(t.numel() * torch.empty((), dtype=out_dtype(t)).element_size() for t in tensors.values())
    weight_map = {name: file.name for file, shard in zip(files, shards, strict=True) for name in shard}
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _replace(tmp: Path, directory: Path) -> None:
    """Put ``tmp`` where ``directory`` is, keeping the old one until the new one is in."""
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{os.getpid()}"
        directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old)
    else:
        tmp.rename(directory)
