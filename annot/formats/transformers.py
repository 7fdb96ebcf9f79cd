"""transformers' checkpoint format: the files ``save_pretrained`` writes, read with the
key renaming and weight converters transformers applies on load (`transformers_keys`,
`transformers_conversions`), and the config written beside a save."""

from __future__ import annotations

import weakref
from collections.abc import Collection
from pathlib import Path

from torch import nn

from annot.checkpoint_io.converted import Conversions
from annot.checkpoint_io.formats import CheckpointFormat, KeyMap, Sources
from annot.formats.transformers_conversions import plan_conversions
from annot.formats.transformers_keys import KeyRules, checkpoint_renamer, key_rules

__all__ = ["TRANSFORMERS", "TransformersFormat"]


class TransformersFormat(CheckpointFormat):
    """A ``PreTrainedModel``'s checkpoint (annot's own saves of one too)."""

    name = "transformers"

    def key_map(self, model: nn.Module, sources: Sources, names: Collection[str]) -> KeyMap:
        """transformers' renaming of legacy keys (``embed_out`` -> ``lm_head``, a
        base-model prefix added or dropped) and the tensors its converters build from
        several keys (fused MoE experts), for ``model``'s ``names``. Keys that are all
        the model's own names need neither (the usual case: saved by this class), and
        transformers' rules take 0.4-0.7 s to build, so they are built only otherwise."""
        if all(key in names for key in sources):
            return KeyMap()
        rules = _rules(model, names)
        return KeyMap(checkpoint_renamer(model, rules), _conversions(model, rules, sources))

    def write_beside(self, model: nn.Module, folder: Path) -> None:
        """The model's config (``config.json``), as the user has it."""
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(folder)


#: The one instance (the format holds no state of its own).
TRANSFORMERS = TransformersFormat()


def _rules(model: nn.Module, names: Collection[str]) -> KeyRules:
    """`key_rules` of ``model`` over ``names``, kept per model: one `from_pretrained`
    matches keys up to three times (strict check, shape check, load)."""
    cached = _RULES.get(model)
    if cached is None or cached[0] != frozenset(names):
        cached = frozenset(names), key_rules(model, names)
        _RULES[model] = cached
    return cached[1]


def _conversions(model: nn.Module, rules: KeyRules, sources: Sources) -> Conversions:
    """`plan_conversions` of ``sources``, kept per rules and sources."""
    if not rules.converters:
        return Conversions()
    cached = _CONVERSIONS.get(rules)
    if cached is None or cached[0] != sources:
        cached = dict(sources), plan_conversions(model, rules, sources)
        _CONVERSIONS[rules] = cached
    return cached[1]


_RULES: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[str], KeyRules]] = weakref.WeakKeyDictionary()
_CONVERSIONS: weakref.WeakKeyDictionary[KeyRules, tuple[dict, Conversions]] = weakref.WeakKeyDictionary()
