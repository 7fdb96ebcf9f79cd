"""diffusers' checkpoint format: a model folder (``config.json`` with ``_class_name``,
``diffusion_pytorch_model.safetensors`` or shards with
``diffusion_pytorch_model.safetensors.index.json``), alone or as one component folder of
a pipeline (``model_index.json`` naming each component's library and class, each in a
folder of its name: ``transformer/``, ``vae/``, ``text_encoder/``, ...).

diffusers saves a model's own ``state_dict`` names and loads them as they are (its
renaming of old attention-block keys concerns UNets and VAEs of its first releases), so
the key map is the identity: what does not match is missing or unexpected, said as for
any checkpoint. Nothing here imports diffusers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from annot.checkpoint_io.formats import CheckpointFormat, FileNames
from annot.errors import CheckpointError

__all__ = ["DENOISER_COMPONENTS", "DIFFUSERS", "DIFFUSERS_FILES", "PIPELINE_INDEX", "Component",
           "DiffusersFormat", "component_folder", "is_diffusers_folder", "pipeline_components"]

DIFFUSERS_FILES = FileNames("diffusion_pytorch_model.safetensors",
                            "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model")
#: The file that makes a folder a diffusers pipeline.
PIPELINE_INDEX = "model_index.json"
#: The component a pipeline trains, by default: the first of these it has (the denoiser).
DENOISER_COMPONENTS = ("transformer", "unet", "prior", "decoder")


@dataclass(frozen=True)
class Component:
    """One component of a pipeline: its folder name, the library that defines its class
    (``"diffusers"``, ``"transformers"``, ...) and the class name."""

    name: str
    library: str
    cls: str


def is_diffusers_folder(path: Path) -> bool:
    """A diffusers pipeline folder, or a diffusers model folder (its ``config.json`` names
    a ``_class_name`` and the ``_diffusers_version`` that wrote it)."""
    if (path / PIPELINE_INDEX).is_file():
        return True
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    return isinstance(config, dict) and "_class_name" in config and "_diffusers_version" in config


def pipeline_components(path: Path) -> list[Component]:
    """The components ``model_index.json`` of the pipeline folder ``path`` lists that
    have a folder (schedulers, tokenizers and processors included; entries set to
    ``null`` are left out)."""
    index = _read_json(path / PIPELINE_INDEX)
    if not isinstance(index, dict):
        raise CheckpointError(f"{path / PIPELINE_INDEX}: not a JSON object")
    out = []
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        library, cls = value
        if isinstance(library, str) and isinstance(cls, str) and (path / name).is_dir():
            out.append(Component(name, library, cls))
    return out


def component_folder(path: Path, component: str | None) -> Path:
    """The folder of ``component`` in the pipeline folder ``path`` (``None``: the
    denoiser, `DENOISER_COMPONENTS`), or ``path`` itself when it is not a pipeline (a
    component named for a model folder is refused). Raises `CheckpointError` naming the
    components the pipeline has when the one asked for is not among them."""
    if not (path / PIPELINE_INDEX).is_file():
        if component is not None:
            raise CheckpointError(f"{path} is not a diffusers pipeline folder (no {PIPELINE_INDEX}), "
                                  f"so it has no component {component!r}: pass the folder alone")
        return path
    components = {c.name: c for c in pipeline_components(path)}
    if component is None:
        component = next((name for name in DENOISER_COMPONENTS if name in components), None)
        if component is None:
            raise CheckpointError(
                f"{path}: a pipeline without a denoiser ({', '.join(DENOISER_COMPONENTS)}); name the "
                f"component to load: component= one of {', '.join(sorted(components))}")
    if component not in components:
        raise CheckpointError(f"{path}: the pipeline has no component {component!r} (it has "
                              f"{', '.join(sorted(components)) or 'none with a folder'})")
    return path / component


class DiffusersFormat(CheckpointFormat):
    """A diffusers model's checkpoint (a model folder; `component_folder` finds one in a
    pipeline)."""

    name = "diffusers"
    files = DIFFUSERS_FILES

    def write_beside(self, model: nn.Module, folder: Path) -> None:
        """The model's config (``config.json``), written by diffusers' ``save_config``."""
        saver: Any = getattr(model, "save_config", None)
        if saver is not None:
            saver(folder)


#: The one instance (the format holds no state of its own).
DIFFUSERS = DiffusersFormat()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
