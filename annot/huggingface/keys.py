"""Checkpoint key names of transformers models: what a file calls a tensor vs what the
model calls it (transformers' own renaming rules, looked up per model class)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from annot.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__ = ["checkpoint_renamer", "peft_base_name", "peft_renamer"]

# PeftModel -> LoraModel -> the transformers model: the prefix of every base name.
PEFT_PREFIX = "base_model.model."


def peft_base_name(name: str, adapter: str) -> str:
    """The base model's name for a PEFT model's tensor name (a LoRA layer keeps the base
    weight as ``base_layer``; ``modules_to_save`` keeps a trained copy)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")


def peft_renamer(model: Any) -> Callable[[str], str]:
    """``rename(checkpoint_key) -> model_key`` for a PEFT model loading its base model's
    checkpoint: transformers' renaming for the base model, then the base name to the PEFT
    name. Adapter tensors are in no base checkpoint: they keep their initialization."""
    from annot.huggingface.model import is_pretrained_model

    base = model.get_base_model()
    adapter = model.active_adapter
    base_rename = checkpoint_renamer(base) if is_pretrained_model(base) else (lambda key: key)
    to_peft = {peft_base_name(name, adapter): name for name in model.state_dict()
               if ".lora_" not in name and ".original_module." not in name}

    def rename(key: str) -> str:
        return to_peft.get(base_rename(key), key)

    return rename



def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """``rename(checkpoint_key) -> model_key`` for a ``PreTrainedModel``: transformers 5
    renames keys between the model and its files (legacy names, ``embed_out`` ->
    ``lm_head``, a base-model prefix added or dropped), and ``save_pretrained`` writes the
    file names. Uses transformers' own mapping for this model. A key that one of its
    weight converters would fuse or split (some MoE and vision checkpoints) cannot be read
    row by row: `annot.CheckpointError` names it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with _bare_classes(model):
        mapping = get_model_conversion_mapping(cast("PreTrainedModel", model))  # callers pass one
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
