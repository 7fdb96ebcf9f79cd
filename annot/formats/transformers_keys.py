"""Checkpoint key names of transformers models: what a file calls a tensor vs what the
model calls it (transformers' own renaming and converter rules, looked up per model class)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from annot.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__ = ["KeyRules", "checkpoint_renamer", "key_rules"]


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


def key_rules(model: nn.Module, names: Iterable[str] | None = None) -> KeyRules:
    """transformers' own key mapping for ``model`` (a ``PreTrainedModel``, possibly
    FSDP2-sharded) over its state ``names`` (default: its ``state_dict``'s keys); building
    it takes about 0.4 s."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    with _bare_classes(model):
        mapping = get_model_conversion_mapping(cast("PreTrainedModel", model))  # callers pass one
    # Shapes only: the state dict of a meta or sharded model is names and metadata.
    return KeyRules([m for m in mapping if isinstance(m, WeightRenaming)],
                    [m for m in mapping if isinstance(m, WeightConverter)],
                    getattr(model, "base_model_prefix", None) or None,
                    dict.fromkeys(model.state_dict() if names is None else names, True))


def checkpoint_renamer(model: nn.Module, rules: KeyRules | None = None) -> Callable[[str], str]:
    """``rename(checkpoint_key) -> model_key`` for a ``PreTrainedModel``: transformers 5
    renames keys between the model and its files (legacy names, ``embed_out`` ->
    ``lm_head``, a base-model prefix added or dropped), and ``save_pretrained`` writes the
    file names. Uses transformers' own mapping for this model (``rules``, or built here).
    A key that one of its weight converters fuses or splits into a model tensor (MoE
    experts) is read through `annot.formats.transformers_conversions` (through a PEFT model too, on its
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
