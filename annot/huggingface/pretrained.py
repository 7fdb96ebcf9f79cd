"""HuggingFace transformers: `from_pretrained` in one call, and what `auto_wrap` adjusts
on any ``PreTrainedModel``.

`from_pretrained` reads a local model directory (``config.json`` plus safetensors, one file
or shards with an index), builds the model under `annot.meta_init` (nothing allocated),
and hands it to `annot.auto_wrap` with ``load_from=`` the directory: FSDP2 shards the
model on the meta device first, then each rank reads only its own rows of every tensor;
the initialization of what the checkpoint provides is never run, and non-persistent
buffers (rotary frequencies, masks, scales) are recomputed from the construction record.

`prepare_for_training` is what `auto_wrap` does to a ``PreTrainedModel`` before
checkpointing it: transformers' own activation checkpointing is turned off when annot
checkpoints (recomputation is never stacked), and ``use_cache`` is turned off whenever
either checkpoints (a key/value cache is useless in training and transformers refuses it
with checkpointing). Both are logged.

transformers is imported inside the functions, so ``import annot`` stays light.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from annot.checkpoint_io.loading import CheckpointError

__all__ = [
    "AUTO_CLASS_ORDER",
    "PretrainedPathError",
    "build_pretrained",
    "from_pretrained",
    "is_pretrained_model",
    "keep_in_fp32_names",
    "prepare_for_training",
]

logger = logging.getLogger("annot.huggingface.pretrained")

# Tried in this order when neither ``auto_class=`` nor the config's ``architectures``
# names a class transformers has: the head a training script most likely wants first.
AUTO_CLASS_ORDER = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
    "AutoModel",
)


class PretrainedPathError(CheckpointError):
    """The path given to `annot.from_pretrained` is not a local HuggingFace model directory."""


def is_pretrained_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``, recognised by attribute (no import)."""
    return hasattr(model, "config") and hasattr(type(model), "_no_split_modules") and hasattr(
        model, "post_init")


def from_pretrained(
    path: str | os.PathLike[str],
    engine: str | None = "fsdp2",
    *,
    torch_dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    auto_class: type | str | None = None,
    strict: bool = False,
    **auto_wrap_options: Any,
) -> Any:
    """Load the transformers model saved in the local directory ``path``, wrapped for ``engine``.

    Steps: read ``config.json`` (offline: the hub is never contacted); pick the class
    (``auto_class`` if given, a class or a name like ``"AutoModelForCausalLM"``; else the
    config's ``architectures``; else the first of `AUTO_CLASS_ORDER` that knows the
    config); build it under `annot.meta_init` in ``torch_dtype`` (``None``/``"auto"``: the
    config's ``dtype``, else float32), keeping ``_keep_in_fp32_modules`` in float32 as
    transformers does (for float16; ``_keep_in_fp32_modules_strict`` also for bfloat16);
    then ``annot.auto_wrap(model, engine, load_from=path, **auto_wrap_options)``.

    Memory: with ``engine="fsdp2"`` each rank allocates and reads only its shards, no rank
    ever holds the whole model; with ``"fsdp1"`` and DeepSpeed ZeRO-3 a rank also holds
    one unit's full tensors while the engine shards it, then reads the rows its shards
    cover. ``"ddp"`` and ZeRO-1/2 keep whole parameters, so every rank loads all of it.
    The initialization of loaded weights is skipped in every case.

    Keys: as with transformers, weights the files lack (a new head) keep their
    initialization and keys the model lacks (a head it does not have) are ignored, both
    logged as a warning; ``strict=True`` refuses either with `annot.CheckpointError`
    listing them, before anything is allocated.

    ``engine=None`` returns the bare model, loaded and in eval mode like transformers'
    ``from_pretrained`` (no process group needed). With an engine the model is in training
    mode, as `auto_wrap` returns it. Raises `PretrainedPathError` when ``path`` is not a
    local directory with a ``config.json``.
    """
    from annot.wrap import auto_wrap

    path = _model_dir(path)
    model = build_pretrained(path, torch_dtype=torch_dtype, trust_remote_code=trust_remote_code,
                             auto_class=auto_class)
    if strict:
        _refuse_mismatch(model, path)
    if engine is None:
        if auto_wrap_options:
            raise ValueError(f"engine=None takes no auto_wrap options, got {', '.join(auto_wrap_options)}")
        from annot.checkpoint_io.loading import load_logged

        load_logged(model, path, None)
        return model.eval()
    return auto_wrap(model, engine, load_from=path, **auto_wrap_options)


def _refuse_mismatch(model: nn.Module, path: Path) -> None:
    from annot.checkpoint_io.loading import check_keys

    missing, unexpected = check_keys(model, path)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match {type(model).__name__}: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]} (strict=True; strict=False initializes what is "
            "missing and ignores the rest, as transformers does)")


def _model_dir(path: str | os.PathLike[str]) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise PretrainedPathError(
            f"{path}: not a local directory. annot.from_pretrained reads a model saved with "
            "save_pretrained (or downloaded with `huggingface-cli download`); it never "
            "contacts the hub")
    if not (directory / "config.json").is_file():
        raise PretrainedPathError(
            f"{directory}: no config.json, so this is not a HuggingFace model directory "
            "(save one with model.save_pretrained(directory))")
    return directory


def build_pretrained(
    path: str | os.PathLike[str],
    *,
    torch_dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    auto_class: type | str | None = None,
) -> nn.Module:
    """The model of ``path``'s config, built under `annot.meta_init` (no weights read):
    what `from_pretrained` loads into. Options as there."""
    # Read at import by huggingface_hub, so set before transformers is first imported;
    # local_files_only below covers a process that imported it already.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    from annot.meta.deferred import meta_init

    path = _model_dir(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    dtype = _resolve_dtype(torch_dtype, config)
    factory = _model_factory(config, auto_class, trust_remote_code)
    with meta_init():
        model = factory(config, dtype=dtype)
        # Inside the block, so the casts are on the record and replayed.
        for module_path in keep_in_fp32_names(model, dtype):
            model.get_submodule(module_path).float()
    return model


def _resolve_dtype(torch_dtype: torch.dtype | str | None, config: Any) -> torch.dtype:
    if torch_dtype is None or torch_dtype == "auto":
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(torch_dtype, str):
        resolved = getattr(torch, torch_dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"torch_dtype={torch_dtype!r} is not a torch dtype")
        return resolved
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"torch_dtype must be a torch.dtype, a name or 'auto', not {torch_dtype!r}")
    return torch_dtype


def _model_factory(config: Any, auto_class: type | str | None, trust_remote_code: bool):
    """``factory(config, dtype=...)`` building the model class for ``config``."""
    import transformers

    if isinstance(auto_class, str):
        found = getattr(transformers, auto_class, None)
        if found is None:
            raise ValueError(f"auto_class={auto_class!r}: transformers has no such class")
        auto_class = found
    if auto_class is None:
        for name in getattr(config, "architectures", None) or ():
            concrete = getattr(transformers, name, None)
            if isinstance(concrete, type) and hasattr(concrete, "_from_config"):
                auto_class = concrete
                break
    if auto_class is None:
        for name in AUTO_CLASS_ORDER:
            candidate = getattr(transformers, name)
            if type(config) in candidate._model_mapping or (
                    trust_remote_code and name in (getattr(config, "auto_map", None) or {})):
                auto_class = candidate
                break
        else:
            raise ValueError(
                f"no transformers auto class knows {type(config).__name__}: pass auto_class=")
    if hasattr(auto_class, "_model_mapping"):  # an Auto* class
        return lambda cfg, dtype: auto_class.from_config(cfg, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
    return lambda cfg, dtype: auto_class._from_config(cfg, dtype=dtype)


def keep_in_fp32_names(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Paths of the modules transformers keeps in float32 when loading in ``dtype``:
    ``_keep_in_fp32_modules`` for float16, plus ``_keep_in_fp32_modules_strict`` for
    float16 and bfloat16 (transformers 5's rule). A name matches a module whose path has
    it as a component."""
    from annot.policies.rules import declared_names, modules_named

    names = declared_names(model, "_keep_in_fp32_modules_strict") if dtype in (
        torch.float16, torch.bfloat16) else []
    if dtype == torch.float16:
        names += [n for n in declared_names(model, "_keep_in_fp32_modules") if n not in names]
    return modules_named(model, names) if names else []


def prepare_for_training(model: nn.Module, *, checkpointing: bool) -> list[str]:
    """Adjust a ``PreTrainedModel`` for `auto_wrap`; returns what was changed, in words
    (each also logged on the ``annot.huggingface.pretrained`` logger).

    ``checkpointing``: whether annot checkpoints some of its units. If so and
    transformers' own activation checkpointing is on, it is turned off (annot's runs
    inside the engine's units). If not, transformers' stays and is what checkpoints.
    Either way, when something checkpoints, ``config.use_cache`` is set to False.
    """
    notes: list[str] = []
    theirs = _hf_checkpointing(model)
    if theirs and checkpointing:
        disable = getattr(model, "activation_checkpointing_disable", None) or \
            model.gradient_checkpointing_disable
        disable()
        notes.append("turned off transformers' gradient checkpointing: annot checkpoints the "
                     "Plan's units instead (stacking both would recompute every layer twice)")
    elif theirs:
        notes.append("kept transformers' gradient checkpointing: annot checkpoints nothing here")
    if checkpointing or theirs:
        for config in _configs(model):
            if getattr(config, "use_cache", False):
                config.use_cache = False
                notes.append(f"set {type(config).__name__}.use_cache = False: a key/value cache "
                             "is not used in training and does not mix with checkpointing")
    for note in notes:
        logger.warning("%s: %s", type(model).__name__, note)
    return notes


def _hf_checkpointing(model: nn.Module) -> bool:
    flag = getattr(type(model), "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(type(model), "is_gradient_checkpointing", None)
    return bool(flag.__get__(model)) if isinstance(flag, property) else False


def _configs(model: nn.Module) -> list[Any]:
    """Every config the model's modules read: the root's, its sub-configs, and the copies
    some submodules keep (T5's encoder and decoder stacks hold their own, so setting the
    root's ``use_cache`` alone leaves the decoder caching)."""
    out: list[Any] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            continue
        for candidate in (config, *(getattr(config, key, None)
                                    for key in getattr(config, "sub_configs", None) or ())):
            if candidate is not None and all(candidate is not seen for seen in out):
                out.append(candidate)
    return out


def checkpoint_renamer(model: nn.Module):
    """``rename(checkpoint_key) -> model_key`` for a ``PreTrainedModel``: transformers 5
    renames keys between the model and its files (legacy names, ``embed_out`` ->
    ``lm_head``, a base-model prefix added or dropped), and ``save_pretrained`` writes the
    file names. Uses transformers' own mapping for this model. A key that one of its
    weight converters would fuse or split (some MoE and vision checkpoints) cannot be read
    row by row: `annot.CheckpointError` names it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with _bare_classes(model):
        mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    # Shapes only: the state dict of a meta or sharded model is names and metadata.
    names = {name: True for name in model.state_dict()}
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        renamed, converter = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # as transformers: the name was right
            renamed, converter = key, None
        if converter is not None:
            raise CheckpointError(
                f"{key}: transformers converts this tensor on load ({converter!r} fuses or "
                "splits tensors), which annot.load cannot do slice by slice yet; load the "
                "model with transformers and annot.save it once to get a plain checkpoint")
        return renamed

    return rename


@contextlib.contextmanager
def _bare_classes(model: nn.Module) -> Iterator[None]:
    """Give FSDP2-sharded modules their own class back for the block: ``fully_shard``
    swaps a module's class for a subclass named ``FSDP<Name>``, and transformers looks
    its key mappings up by class name (``GPTNeoXForCausalLM`` has its own)."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        bare = cls.__bases__[-1] if len(cls.__bases__) > 1 else None
        if bare is not None and cls.__name__ == f"FSDP{bare.__name__}":
            swapped.append((module, cls))
            module.__class__ = bare
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
