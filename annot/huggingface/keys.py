"""Checkpoint key names of transformers models: what a file calls a tensor vs what the
model calls it (transformers' own renaming rules, looked up per model class)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from annot.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__ = [
    "KeyRules", "checkpoint_renamer", "key_rules", "peft_base_name", "peft_copy_sources",
    "peft_key_rules", "peft_names", "peft_renamer",
]

# PeftModel -> LoraModel -> the transformers model: the prefix of every base name.
PEFT_PREFIX = "base_model.model."


def peft_base_name(name: str, adapter: str) -> str:
    """The base model's name for a PEFT model's tensor name (a LoRA layer keeps the base
    weight as ``base_layer``; ``modules_to_save`` keeps a trained copy)."""
    name = name.removeprefix(PEFT_PREFIX)
    while ".base_layer." in name:  # nested once per wrap: LoRA on two parameters of one
        name = name.replace(".base_layer.", ".")  # module (`target_parameters`) wraps it twice
    return name.replace(f".modules_to_save.{adapter}.", ".")


def peft_key_rules(model: Any) -> tuple[KeyRules | None, dict[str, str]]:
    """For a PEFT model loading its base model's checkpoint: transformers' rules for the
    base model over the base model's own names (``None`` when the base is not a
    transformers model), and each base name -> the PEFT model's name for it (adapter
    tensors, in no base checkpoint, are left out).

    The base model's own names, as its checkpoint has them: PEFT wraps what it adapts,
    and a parameter it adapts in place (`target_parameters`, e.g. fused MoE experts)
    moves under ``base_layer``. Matched against the wrapped names, a converted key found
    no target, was dropped as unexpected, and the experts kept their random
    initialization (strict=False) with no word said (docs/design.md, pitfall 52)."""
    from annot.huggingface.model import is_pretrained_model

    base = model.get_base_model()
    adapter = model.active_adapter
    rules = None
    if is_pretrained_model(base):
        rules = key_rules(base)
        rules = dataclasses.replace(rules, names=dict.fromkeys((peft_base_name(n, adapter) for n in rules.names), True),
                                    resolved={})
    return rules, peft_names(model)


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


def peft_renamer(model: Any, rules_and_names: tuple[KeyRules | None, dict[str, str]] | None = None
                 ) -> Callable[[str], str]:
    """``rename(checkpoint_key) -> model_key`` for a PEFT model loading its base model's
    checkpoint: transformers' renaming for the base model, then the base name to the PEFT
    name (``rules_and_names``: `peft_key_rules`'s, or built here). Adapter tensors are in
    no base checkpoint: they keep their initialization."""
    rules, to_peft = rules_and_names if rules_and_names is not None else peft_key_rules(model)
    base_rename: Callable[[str], str] = lambda key: key  # noqa: E731
    if rules is not None:
        base_rename = checkpoint_renamer(model.get_base_model(), rules)

    def rename(key: str) -> str:
        return to_peft.get(base_rename(key), key)

    return rename


@dataclasses.dataclass(frozen=True, eq=False)
class KeyRules:
    """transformers' renaming rules for one model (`key_rules`): its `WeightRenaming` rules,
    its `WeightConverter` rules (tensors it fuses or splits on load), the base-model prefix
    and the model's state names."""

    renamings: list[Any]
    converters: list[Any]
    prefix: str | None
    names: dict[str, bool]
    # Each key resolved once: the planning of conversions and the renamer ask for every
    # key, and one `from_pretrained` matches keys up to three times.
    resolved: dict[str, tuple[str, Any, str | None]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)

    def resolve(self, key: str) -> tuple[str, Any, str | None]:
        """``(model name, converter, its source pattern)`` for a checkpoint key, as
        transformers' loader resolves it; converter and pattern are ``None`` for a key
        that is only renamed."""
        if key not in self.resolved:
            self.resolved[key] = self._resolve(key)
        return self.resolved[key]

    def _resolve(self, key: str) -> tuple[str, Any, str | None]:
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.names)
        if renamed not in self.names and key in self.names:  # as transformers: the name was right
            return key, None, None
        if pattern is None:
            return renamed, None, None
        # As transformers' `pattern_to_converter`: the last converter with the pattern.
        converter = next(c for c in reversed(self.converters) if pattern in c.source_patterns)
        return renamed, converter, pattern


def key_rules(model: nn.Module) -> KeyRules:
    """transformers' own key mapping for ``model`` (a ``PreTrainedModel``, possibly
    FSDP2-sharded); building it takes about 0.4 s."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    with _bare_classes(model):
        mapping = get_model_conversion_mapping(cast("PreTrainedModel", model))  # callers pass one
    # Shapes only: the state dict of a meta or sharded model is names and metadata.
    return KeyRules([m for m in mapping if isinstance(m, WeightRenaming)],
                    [m for m in mapping if isinstance(m, WeightConverter)],
                    getattr(model, "base_model_prefix", None) or None,
                    {name: True for name in model.state_dict()})


def checkpoint_renamer(model: nn.Module, rules: KeyRules | None = None) -> Callable[[str], str]:
    """``rename(checkpoint_key) -> model_key`` for a ``PreTrainedModel``: transformers 5
    renames keys between the model and its files (legacy names, ``embed_out`` ->
    ``lm_head``, a base-model prefix added or dropped), and ``save_pretrained`` writes the
    file names. Uses transformers' own mapping for this model (``rules``, or built here).
    A key that one of its weight converters fuses or splits into a model tensor (MoE
    experts) is read by `annot.huggingface.conversions` (through a PEFT model too, on its
    base model's names), not renamed: one that reaches this renamer all the same is
    refused by name with `annot.CheckpointError`; one whose converted name the model
    lacks stays as it is (an unexpected key)."""
    rules = rules if rules is not None else key_rules(model)

    def rename(key: str) -> str:
        renamed, converter, _ = rules.resolve(key)
        if converter is None:
            return renamed
        if renamed not in rules.names:
            return key
        raise CheckpointError(
            f"{key}: transformers converts this tensor on load ({converter!r} fuses or "
            "splits tensors), which annot.load does slice by slice where it plans the "
            "conversions (annot.load of a transformers or PEFT model); here it reached a "
            "plain rename: load the model with annot.from_pretrained and annot.save it "
            "once (it writes the model's own names)")

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
