"""`annot.materialize`, `annot.load`, `annot.save` on a model any engine has sharded.

The work is engine-blind (`annot.meta.materialization`, `annot.checkpoint_io`); this
module asks the engines where this rank keeps each parameter and passes that along.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from annot.checkpoint_io import loading, saving
from annot.checkpoint_io.loading import LoadReport
from annot.engines.layout import shard_layout
from annot.meta import materialization

__all__ = ["load", "materialize", "save"]


def materialize(model: nn.Module, *, device: torch.device | str | None = None,
                progress: bool | None = None) -> nn.Module:
    """Give a `meta_init` model its values, only this rank's shards of a sharded one
    (`annot.meta.materialization.materialize`). Returns the model."""
    return materialization.materialize(model, device=device, progress=progress,
                                       layout=shard_layout(model))


def load(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
         device: torch.device | str | None = None) -> LoadReport:
    """Load a checkpoint into ``model``, each rank reading only the rows it keeps
    (`annot.checkpoint_io.loading.load`)."""
    return loading.load(model, path, strict=strict, device=device, layout=shard_layout(model))


def save(model: nn.Module, directory: str | os.PathLike[str], *,
         max_shard_bytes: int = saving.DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None,
         overwrite: bool = False) -> list[Path]:
    """Write ``model`` as HuggingFace-compatible safetensors (`annot.checkpoint_io.saving.save`)."""
    return saving.save(model, directory, max_shard_bytes=max_shard_bytes, dtype=dtype,
                       overwrite=overwrite, layout=shard_layout(model))
