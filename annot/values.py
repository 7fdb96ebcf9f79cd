"""`annot.materialize`, `annot.load`, `annot.save` on a model any engine has sharded.

The work is engine-blind (`annot.meta.materialization`, `annot.checkpoint_io`); this
module asks the engines (`annot.engines.layout`, through the engine contract, never an
engine's module) where this rank keeps each parameter, passes that along, and tells them
afterwards what was written.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from annot._deprecation import warn_deprecated
from annot.checkpoint_io import loading, saving
from annot.checkpoint_io.loading import LoadReport
from annot.engines.base import Trainable
from annot.engines.layout import after_write, shard_layout
from annot.formats.choice import PeftExport, checkpoint_source, save_format
from annot.meta import materialization

__all__ = ["load", "materialize", "save"]


def materialize(model: nn.Module, *, device: torch.device | str | None = None,
                progress: bool | None = None,
                skip: set[str] | frozenset[str] | None = None) -> nn.Module:
    """Give a `meta_init` model its values, only this rank's shards of a sharded one
    (`annot.meta.materialization.materialize`). Returns the model.

    ``skip`` (deprecated, removed in 0.3.0): names of parameters the caller fills itself,
    whose initialization is not replayed; `annot.load` and ``auto_wrap(..., load_from=)``
    skip what their checkpoint provides by themselves."""
    if skip is not None:
        warn_deprecated("annot.materialize(skip=...)",
                        "annot.load(model, path) or auto_wrap(..., load_from=path), which skip "
                        "what the checkpoint provides")
    materialization.materialize(model, device=device, progress=progress,
                                skip=frozenset(skip or ()), layout=shard_layout(model))
    after_write(model)
    return model


def load(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
         device: torch.device | str | None = None, dcp: bool = False,
         prefix: str | None = None, mmap: bool = False) -> LoadReport:
    """Load a checkpoint into ``model``, each rank reading only the rows it keeps
    (`annot.checkpoint_io.loading.load`): safetensors in the format of the model's
    library (`annot.formats.choice.checkpoint_source`: annot's own, transformers', PEFT
    over its base model's, diffusers', the denoiser of a diffusers pipeline folder), the
    model of an `annot.save_state` training state, or (``dcp=True``) a torch distributed
    checkpoint whose keys carry ``prefix`` (found from the keys if not given).
    ``mmap=True`` maps safetensors into a meta model instead of reading them
    (copy-on-write; the files must not change while the model lives)."""
    layout = shard_layout(model)
    source = checkpoint_source(layout.bare_model(model), path)
    report = loading.load(model, source.path, strict=strict, device=device, layout=layout,
                          dcp=dcp, prefix=prefix, mmap=mmap, format=source.format)
    after_write(model)
    return report


def save(model: nn.Module | Trainable, directory: str | os.PathLike[str], *,
         max_shard_bytes: int = saving.DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None,
         overwrite: bool = False, peft: PeftExport | None = None) -> list[Path]:
    """Write ``model`` (plain, FSDP2, FSDP1 or ZeRO-3) as safetensors in its library's
    layout (transformers' and annot's own names; a diffusers model as diffusers writes
    it), each rank writing its own rows or one tensor gathered at a time; a PEFT model as
    its adapter or merged (``peft=``) (`annot.checkpoint_io.saving.save`,
    `annot.formats.choice.save_format`)."""
    target = saved_module(model)
    layout = shard_layout(target)
    format = save_format(layout.bare_model(target), peft)
    return saving.save(target, directory, max_shard_bytes=max_shard_bytes, dtype=dtype,
                       overwrite=overwrite, layout=layout, format=format)


def saved_module(model: nn.Module | Trainable) -> nn.Module:
    """The module whose state a save reads: an FSDP1 model through its root wrapper (the
    root's own shard holds what no unit does), any other through the bare model (DDP's
    and DeepSpeed's wrappers add a ``module.`` level to every name)."""
    if isinstance(model, Trainable):
        return model.module if model.engine == "fsdp1" else model.model
    inner = model._modules.get("module")
    if inner is not None and len(model._modules) == 1:  # DDP, DeepSpeedEngine
        return inner
    return model
