"""diffusers models: the class a model folder's config names, built with nothing
allocated in the dtype diffusers would load it in.

A diffusers model folder holds ``config.json``, which names the class (``_class_name``,
e.g. ``FluxTransformer2DModel``) and its constructor's arguments. diffusers'
``from_pretrained`` builds the class on the meta device with ``torch_dtype`` as the
default dtype (float32 when none is given) and casts each loaded tensor to it, except
the tensors one of whose dotted name components the class lists in
``_keep_in_fp32_modules``: those become float32 whatever the dtype (Wan keeps its time
embedder, its norms and every ``scale_shift_table``, a bare parameter on the model and
on each block). `build` does the same on the meta device or under `annot.meta_init`,
so buffers the constructor computes and the values loaded later have the dtypes
diffusers gives them. diffusers is imported inside the functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from annot.errors import CheckpointError

__all__ = ["build", "diffusers_class", "kept_in_fp32", "read_config"]


def read_config(folder: Path) -> dict[str, Any]:
    """The config of the diffusers model folder ``folder`` (its ``config.json``), checked
    to name a class."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        raise CheckpointError(f"{path}: no _class_name, so this is not a diffusers model folder")
    return config


def diffusers_class(config: dict[str, Any]) -> type[nn.Module]:
    """The diffusers class ``config`` names; `CheckpointError` when diffusers is not
    installed or has no such model class."""
    try:
        import diffusers
    except ImportError:
        raise CheckpointError(f"{config['_class_name']} is a diffusers model: pip install "
                              "'annot-train[diffusers]'") from None
    cls = getattr(diffusers, config["_class_name"], None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_config")):
        raise CheckpointError(f"diffusers {diffusers.__version__} has no model class "
                              f"{config['_class_name']!r} (the config's _class_name)")
    return cls


def kept_in_fp32(model: nn.Module) -> list[str]:
    """The parameter and buffer names diffusers keeps in float32 whatever the dtype: one
    of whose dotted components is in the class's ``_keep_in_fp32_modules``."""
    names = getattr(model, "_keep_in_fp32_modules", None) or []
    if isinstance(names, str):
        names = [names]
    wanted = set(names)
    return [name for name, _ in (*model.named_parameters(), *model.named_buffers())
            if wanted & set(name.split("."))]


def build(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The model of ``config`` as diffusers loads it in ``dtype``: constructed with
    ``dtype`` as the default dtype, then the tensors `kept_in_fp32` cast to float32 (call
    it on the meta device or under `annot.meta_init`, where the cast is recorded, not
    computed)."""
    cls: Any = diffusers_class(config)
    if not dtype.is_floating_point:
        raise ValueError(f"torch_dtype={dtype}: a diffusers model is built in a floating-point dtype")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = cls.from_config(config)
    finally:
        torch.set_default_dtype(default)
    if dtype != torch.float32:
        kept = set(kept_in_fp32(model))
        keep = {id(t) for name, t in (*model.named_parameters(), *model.named_buffers()) if name in kept}
        model._apply(_to_float32(keep))
    return model


def _to_float32(keep: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """For ``Module._apply``: the floating tensors of ``keep`` (by id) in float32, every
    other tensor as it is."""
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if id(tensor) in keep and tensor.is_floating_point() else tensor

    return cast
