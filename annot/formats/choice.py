"""Which checkpoint format reads a path into a model, or writes a model: the one place
the choice is made (`annot.load`, `annot.save`, ``auto_wrap(load_from=...)``,
`annot.from_pretrained`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from torch import nn

from annot.checkpoint_io.formats import PLAIN, CheckpointFormat, CheckpointSource
from annot.errors import CheckpointError
from annot.formats.diffusers import DIFFUSERS, PIPELINE_INDEX, component_folder, is_diffusers_folder
from annot.formats.peft import PeftAdapterExport, PeftBaseFormat, PeftMergedExport
from annot.formats.transformers import TRANSFORMERS
from annot.huggingface.model import is_diffusers_model, is_peft_model, is_pretrained_model

__all__ = ["PeftExport", "checkpoint_source", "model_format", "save_format"]

PeftExport = Literal["adapter", "merged"]


def model_format(model: nn.Module) -> CheckpointFormat:
    """The format of ``model``'s own library (the bare model: no engine's wrapper):
    PEFT over its base model's, transformers', diffusers', else annot's own."""
    if is_peft_model(model):
        peft_model: Any = model  # PEFT's own method
        return PeftBaseFormat(model_format(peft_model.get_base_model()))
    if is_pretrained_model(model):
        return TRANSFORMERS
    if is_diffusers_model(model):
        return DIFFUSERS
    return PLAIN


def checkpoint_source(model: nn.Module, path: str | os.PathLike[str] | CheckpointSource,
                      *, component: str | None = None) -> CheckpointSource:
    """What to read into the bare ``model`` from ``path``: the folder holding its weights
    (``component`` of a diffusers pipeline folder, by default its denoiser) and the
    format of the model's library (`model_format`). A `CheckpointSource` is returned as
    it is."""
    if isinstance(path, CheckpointSource):
        return path
    folder = Path(path)
    if folder.is_dir() and (folder / PIPELINE_INDEX).is_file():
        folder = component_folder(folder, component)
    elif component is not None:
        raise CheckpointError(f"component={component!r}: {folder} is not a diffusers pipeline folder "
                              f"(no {PIPELINE_INDEX})")
    format = model_format(model)
    if format is PLAIN and folder.is_dir() and is_diffusers_folder(folder):
        format = DIFFUSERS  # a model of the user's own, saved in diffusers' layout
    return CheckpointSource(folder, format)


def save_format(model: nn.Module, peft: PeftExport | None = None) -> CheckpointFormat:
    """The format `annot.save` writes the bare ``model`` in: its library's (a diffusers
    model in diffusers' layout; transformers' and annot's own are the same files), or
    for a PEFT model ``peft``: ``"adapter"`` (PEFT's adapter files) or ``"merged"`` (the
    base model with the adapters merged in, in its library's layout)."""
    if peft is not None and peft not in ("adapter", "merged"):
        raise ValueError(f"peft={peft!r}: 'adapter' or 'merged'")
    if peft is None and is_peft_model(model):
        raise CheckpointError(
            f"{type(model).__name__} is a PEFT model: pass peft='adapter' (PEFT's adapter "
            "files, for PeftModel.from_pretrained) or peft='merged' (the base model with the "
            "adapters merged in, for its library's from_pretrained)")
    if peft is not None and not is_peft_model(model):
        raise CheckpointError(f"peft={peft!r}, but {type(model).__name__} is not a PEFT model")
    if peft == "adapter":
        return PeftAdapterExport()
    if peft == "merged":
        peft_model: Any = model
        return PeftMergedExport(model_format(peft_model.get_base_model()))
    return model_format(model)
