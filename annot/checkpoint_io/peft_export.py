"""What `annot.save` writes for a PEFT model: PEFT's adapter files, or the base model with
the LoRA updates merged into its weights. Both from a sharded model, one tensor at a
time; the names follow PEFT's own rules (`peft.utils.get_peft_model_state_dict`) and the
base model's, so PEFT and transformers load the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from annot.checkpoint_io.entries import Entry, entry, full_shape, full_tensor
from annot.errors import CheckpointError
from annot.huggingface.keys import peft_base_name
from annot.meta.layout import ShardLayout

__all__ = ["adapter_entries", "merged_entries"]

def adapter_entries(model: nn.Module, tensors: dict[str, torch.Tensor],
                    layout: ShardLayout) -> tuple[list[Entry], Any]:
    """The active adapter's tensors under PEFT's file names, and its config."""
    from peft.utils import get_peft_model_state_dict

    peft_model: Any = layout.bare_model(model)  # a PeftModel: PEFT's own attributes
    adapter = _active_adapter(peft_model)
    # PEFT picks and renames by key, matching keys with its modules' names as it sees them
    # (inside FSDP1 they carry the wrapper level); meta placeholders stand for the tensors.
    seen = {id(t): name for name, t in peft_model.named_parameters(remove_duplicate=False)}
    placeholders = {seen.get(id(t), name): torch.empty(full_shape(t, layout), dtype=t.dtype,
                                                       device="meta")
                    for name, t in tensors.items()}
    source = {id(p): tensors[layout.clean(name)] for name, p in placeholders.items()}
    chosen = get_peft_model_state_dict(peft_model, state_dict=placeholders, adapter_name=adapter,
                                       save_embedding_layers=False)
    if not chosen:
        raise CheckpointError(f"PEFT found no tensors of adapter {adapter!r} to save")
    entries = [entry(layout.clean(key), source[id(placeholder)], layout)
               for key, placeholder in chosen.items()]
    return entries, peft_model.peft_config[adapter]


def merged_entries(model: nn.Module, tensors: dict[str, torch.Tensor],
                   layout: ShardLayout) -> tuple[list[Entry], Any]:
    """The base model's tensors under its own names, each LoRA ``base_layer.weight``
    with ``scaling * B @ A`` added (PEFT's ``get_delta_weight``), and the base config."""
    peft_model: Any = layout.bare_model(model)  # a PeftModel: PEFT's own attributes
    adapter = _active_adapter(peft_model)
    entries = []
    for name, tensor in tensors.items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged in; a modules_to_save copy replaces its original
        plain = entry(peft_base_name(name, adapter), tensor, layout)
        if name.endswith(".base_layer.weight"):
            lora = peft_model.get_submodule(name.removesuffix(".base_layer.weight"))
            # A computed value has no rows of its own to write: ``source=None`` makes a
            # shared save gather it (`shared_save.owned_pieces`) instead of writing the
            # unmerged base rows.
            plain = dataclasses.replace(plain, fetch=_merged_weight(lora, tensor, adapter, layout, name),
                                        source=None, layout=None)
        entries.append(plain)
    return entries, peft_model.get_base_model().config


def _active_adapter(peft_model: Any) -> str:
    adapter = peft_model.active_adapter
    if not isinstance(adapter, str):
        raise CheckpointError(f"{len(adapter)} adapters are active: activate one to save it")
    config = peft_model.peft_config[adapter]
    if getattr(config, "peft_type", None) is not None and str(config.peft_type.value) != "LORA":
        raise CheckpointError(f"adapter {adapter!r} is {config.peft_type.value}: annot exports LoRA")
    return adapter


def _merged_weight(lora: Any, weight: torch.Tensor, adapter: str, layout: ShardLayout,
                   name: str) -> Callable[[], torch.Tensor]:
    """``fetch`` for a LoRA Linear's merged weight (PEFT's ``get_delta_weight``)."""
    a, b = lora.lora_A[adapter], lora.lora_B[adapter]
    if not isinstance(a, nn.Linear) or getattr(lora, "use_dora", {}).get(adapter):
        raise CheckpointError(
            f"{name}: a merged export supports LoRA on Linear layers without DoRA; save "
            "peft='adapter' instead")
    scaling, fan_in_fan_out = lora.scaling[adapter], bool(getattr(lora, "fan_in_fan_out", False))

    def fetch() -> torch.Tensor:
        # The same three gathers in the same order on every rank.
        full = full_tensor(weight, layout)
        delta = full_tensor(b.weight, layout).float() @ full_tensor(a.weight, layout).float()
        delta = (delta.T if fan_in_fan_out else delta) * scaling
        return (full.float() + delta).to(full.dtype)

    return fetch
