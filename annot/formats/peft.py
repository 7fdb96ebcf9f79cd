"""PEFT's formats: a base model's checkpoint loaded into a PEFT model (`PeftBaseFormat`),
and what `annot.save` writes for a PEFT model: PEFT's adapter files
(`PeftAdapterExport`) or the base model with the LoRA updates merged into its weights
(`PeftMergedExport`), both from a sharded model one tensor at a time, under PEFT's own
names (`peft.utils.get_peft_model_state_dict`) and the base model's, so PEFT and the
base model's library load the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from annot.checkpoint_io.converted import Conversions
from annot.checkpoint_io.entries import Entry, entry, full_shape, full_tensor
from annot.checkpoint_io.formats import CheckpointFormat, FileNames, KeyMap, Sources
from annot.errors import CheckpointError
from annot.meta.layout import ShardLayout
from annot.quantized_tensors import dequantized, is_quantized

__all__ = ["ADAPTER_FILES", "PeftAdapterExport", "PeftBaseFormat", "PeftMergedExport",
           "peft_base_name", "peft_copy_sources", "peft_names"]

#: PEFT's adapter file: always one file, no index.
ADAPTER_FILES = FileNames("adapter_model.safetensors", None, "adapter_model")

# PeftModel -> LoraModel -> the transformers model: the prefix of every base name.
PEFT_PREFIX = "base_model.model."


def peft_base_name(name: str, adapter: str) -> str:
    """The base model's name for a PEFT model's tensor name (a LoRA layer keeps the base
    weight as ``base_layer``; ``modules_to_save`` keeps a trained copy)."""
    name = name.removeprefix(PEFT_PREFIX)
    while ".base_layer." in name:  # nested once per wrap: LoRA on two parameters of one
        name = name.replace(".base_layer.", ".")  # module (`target_parameters`) wraps it twice
    return name.replace(f".modules_to_save.{adapter}.", ".")


def peft_names(model: Any, names: Iterable[str] | None = None) -> dict[str, str]:
    """Base model name -> the PEFT model's name, for every tensor of the base model
    (adapters and PEFT's kept originals left out). ``names``: the PEFT model's state
    names when the caller has them (else its ``state_dict``'s keys)."""
    adapter = model.active_adapter
    return {peft_base_name(name, adapter): name for name in (model.state_dict() if names is None else names)
            if ".lora_" not in name and ".original_module." not in name}


def peft_copy_sources(model: Any, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The base-model tensors each of a PEFT model's module copies is read from: a
    ``modules_to_save`` module keeps the original (``original_module``) and a trained
    copy, both made from the base module, so both take its checkpoint tensor; where the
    base model ties that tensor to another (an ``lm_head`` tied to the embedding, which
    the checkpoint holds once), the tie's source next. PEFT name -> base names in order."""
    adapter = model.active_adapter
    ties = dict(getattr(model.get_base_model(), "all_tied_weights_keys", None) or {})
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        if ".original_module." in name or f".modules_to_save.{adapter}." in name:
            base = peft_base_name(name.replace(".original_module.", "."), adapter)
            out[name] = (base, ties[base]) if base in ties else (base,)
    return out


class PeftBaseFormat(CheckpointFormat):
    """A PEFT model loading its base model's checkpoint, in the base model's format
    (``base``: transformers', diffusers', annot's own): the base format's key map over the
    base model's own names, put onto the PEFT model's names; PEFT's module copies take
    their base tensor's key. Adapter tensors are in no base checkpoint: they keep their
    initialization.

    The base model's own names, as its checkpoint has them: PEFT wraps what it adapts,
    and a parameter it adapts in place (`target_parameters`, e.g. fused MoE experts)
    moves under ``base_layer``. Matched against the wrapped names, a converted key found
    no target, was dropped as unexpected, and the experts kept their random
    initialization (strict=False) with no word said (docs/design.md, pitfall 52)."""

    def __init__(self, base: CheckpointFormat) -> None:
        self.base = base
        self.name = f"PEFT over {base.name}"
        self.files = base.files

    def weights_folder(self, path: Path) -> Path:
        return self.base.weights_folder(path)

    def key_map(self, model: nn.Module, sources: Sources, names: Collection[str]) -> KeyMap:
        peft_model: Any = model  # a PeftModel: PEFT's own attributes
        to_peft = peft_names(peft_model, names)
        base = self.base.key_map(peft_model.get_base_model(), sources, to_peft.keys())
        base_rename = base.rename

        def rename(key: str) -> str:
            return to_peft.get(base_rename(key) if base_rename is not None else key, key)

        conversions = Conversions({to_peft.get(n, n): node for n, node in base.conversions.targets.items()},
                                  base.conversions.consumed)
        copies = {name: tuple(to_peft[b] for b in bases if b in to_peft)
                  for name, bases in peft_copy_sources(peft_model, names).items()}
        return KeyMap(rename, conversions, copies)


class PeftAdapterExport(CheckpointFormat):
    """PEFT's adapter files: ``adapter_model.safetensors`` and ``adapter_config.json``,
    what ``PeftModel.from_pretrained`` loads."""

    name = "PEFT adapter"
    files = ADAPTER_FILES

    def entries(self, model: nn.Module, tensors: dict[str, torch.Tensor],
                layout: ShardLayout) -> list[Entry]:
        return adapter_entries(model, tensors, layout)

    def write_beside(self, model: nn.Module, folder: Path) -> None:
        peft_model: Any = model
        peft_model.peft_config[_active_adapter(peft_model)].save_pretrained(folder)


class PeftMergedExport(CheckpointFormat):
    """The base model with the adapters merged in, in the base model's format
    (``base``), what the base model's library loads."""

    def __init__(self, base: CheckpointFormat) -> None:
        self.base = base
        self.name = f"PEFT merged into {base.name}"
        self.files = base.files

    def entries(self, model: nn.Module, tensors: dict[str, torch.Tensor],
                layout: ShardLayout) -> list[Entry]:
        return merged_entries(model, tensors, layout)

    def write_beside(self, model: nn.Module, folder: Path) -> None:
        peft_model: Any = model
        self.base.write_beside(peft_model.get_base_model(), folder)



def adapter_entries(model: nn.Module, tensors: dict[str, torch.Tensor],
                    layout: ShardLayout) -> list[Entry]:
    """The active adapter's tensors under PEFT's file names."""
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
    return [entry(layout.clean(key), source[id(placeholder)], layout)
            for key, placeholder in chosen.items()]


def merged_entries(model: nn.Module, tensors: dict[str, torch.Tensor],
                   layout: ShardLayout) -> list[Entry]:
    """The base model's tensors under its own names, each LoRA ``base_layer.weight``
    with ``scaling * B @ A`` added (PEFT's ``get_delta_weight``). A quantized base weight
    (QLoRA) is dequantized to its dtype first, each rank its own rows: the merge is into
    the weights the adapters were trained against, not the checkpoint's originals."""
    peft_model: Any = layout.bare_model(model)  # a PeftModel: PEFT's own attributes
    adapter = _active_adapter(peft_model)
    entries = []
    for name, tensor in tensors.items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged in; a modules_to_save copy replaces its original
        plain = entry(peft_base_name(name, adapter), tensor, layout)
        if is_quantized(tensor):  # no rows of its own a checkpoint can hold: computed
            plain = dataclasses.replace(plain, fetch=_dequantized_weight(tensor, layout),
                                        source=None, layout=None)
        if name.endswith(".base_layer.weight"):
            lora = peft_model.get_submodule(name.removesuffix(".base_layer.weight"))
            # A computed value has no rows of its own to write: ``source=None`` makes a
            # shared save gather it (`shared_save.owned_pieces`) instead of writing the
            # unmerged base rows.
            plain = dataclasses.replace(plain, fetch=_merged_weight(lora, tensor, adapter, layout, name),
                                        source=None, layout=None)
        entries.append(plain)
    return entries


def _dequantized_weight(weight: torch.Tensor, layout: ShardLayout) -> Callable[[], torch.Tensor]:
    """``fetch`` for a quantized weight no adapter is merged into: the whole of it,
    dequantized."""
    return lambda: full_tensor(dequantized(weight), layout)


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
        full = full_tensor(dequantized(weight), layout)
        delta = full_tensor(b.weight, layout).float() @ full_tensor(a.weight, layout).float()
        delta = (delta.T if fan_in_fan_out else delta) * scaling
        return (full.float() + delta).to(full.dtype)

    return fetch
