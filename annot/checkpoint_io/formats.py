"""What a checkpoint format tells the generic loader and saver.

`annot.checkpoint_io` reads and writes safetensors checkpoints without knowing which
library made them. A `CheckpointFormat` says the rest, as data and callables: what its
files are called (`FileNames`), which folder holds the weights (a diffusers pipeline keeps
each component in a folder of its own), how the checkpoint's keys meet the model's names
(`KeyMap`: renamed keys, model tensors built from several keys, module copies that take
another tensor's key), which tensors a save writes, and what it writes beside them
(configs). This base class is annot's own format, and any plain safetensors checkpoint:
the model's own names in ``model.safetensors`` (or shards with an index).

The adapters for other libraries' formats (transformers, PEFT, diffusers) live in
`annot.formats`, a layer above this package; nothing here imports them or the libraries
they read (docs/design.md, "The import check"). A format reaches a load as part of a
`CheckpointSource` (a path and its format), chosen by the caller (`annot.load`,
`auto_wrap(load_from=...)`, `annot.from_pretrained`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from annot.checkpoint_io.converted import Conversions

if TYPE_CHECKING:
    from annot.checkpoint_io.entries import Entry
    from annot.meta.layout import ShardLayout

__all__ = ["MODEL_FILES", "PLAIN", "CheckpointFormat", "CheckpointSource", "FileNames", "KeyMap",
           "Sources"]

#: Checkpoint key -> (shape, dtype), read from the files' headers.
Sources = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclasses.dataclass(frozen=True)
class FileNames:
    """How one kind of checkpoint names its safetensors files: one file ``single``, or
    shards ``<stem>-00001-of-00002.safetensors`` listed by ``index`` (``None``: this kind
    is always one file, as PEFT's adapters are)."""

    single: str
    index: str | None
    stem: str

    def shard(self, i: int, n: int) -> str:
        """The name of shard ``i`` (from 0) of ``n``."""
        return f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"

    def pattern(self) -> re.Pattern[str]:
        """Every file name of this kind: what a save replaces and, when the new
        checkpoint lacks it, removes (`annot.checkpoint_io.weights_commit`)."""
        names = [re.escape(self.single), re.escape(self.stem) + r"-\d{5}-of-\d{5}\.safetensors"]
        if self.index is not None:
            names.append(re.escape(self.index))
        return re.compile("|".join(names))


#: transformers' names, which annot's own saves use too.
MODEL_FILES = FileNames("model.safetensors", "model.safetensors.index.json", "model")


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How one checkpoint's keys meet one model's names.

    ``rename``: checkpoint key -> model name (``None``: the same name). ``conversions``:
    model tensors built from several checkpoint keys (read block by block), and the keys
    they use up. ``copies``: model name -> other model names, in order of preference,
    whose checkpoint tensor also fills it when the checkpoint has no key of its own for
    it (PEFT keeps a trained copy of a module beside the original: both take the one
    key the base model's checkpoint has)."""

    rename: Callable[[str], str] | None = None
    conversions: Conversions = dataclasses.field(default_factory=Conversions)
    copies: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


class CheckpointFormat:
    """annot's own format, and plain safetensors: the model's names as they are, in
    `MODEL_FILES`. Subclasses (`annot.formats`) override what their library does
    differently; every method must work on a model on the meta device, sharded or not,
    and read nothing but the files' headers."""

    #: Named in messages.
    name: str = "safetensors"
    files: FileNames = MODEL_FILES

    def weights_folder(self, path: Path) -> Path:
        """The folder (or file) holding the weights of the checkpoint the user named
        ``path``."""
        return path

    def key_map(self, model: nn.Module, sources: Sources, names: Collection[str]) -> KeyMap:
        """How the checkpoint keys ``sources`` meet ``model``'s state ``names`` (the bare
        model: no engine's wrapper levels)."""
        return KeyMap()

    def entries(self, model: nn.Module, tensors: dict[str, torch.Tensor],
                layout: ShardLayout) -> list[Entry]:
        """What a save writes: one `Entry` per tensor of ``tensors`` (the bare model's
        state by name, tied tensors once), under its own name."""
        from annot.checkpoint_io.entries import entry

        return [entry(name, tensor, layout) for name, tensor in tensors.items()]

    def write_beside(self, model: nn.Module, folder: Path) -> None:
        """Write into ``folder`` (a save's staging folder) what the format keeps beside
        the weights of the bare ``model`` (its config); nothing here."""

    def __repr__(self) -> str:
        return f"<{self.name} checkpoint format>"


#: The format of annot's own saves and of any plain safetensors checkpoint.
PLAIN = CheckpointFormat()


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint to load: the path the user gave and the format that reads it."""

    path: Path
    format: CheckpointFormat = PLAIN
    #: Model names that hold their values from this checkpoint before the load reads the
    #: rest (weights quantized on load: `annot.quantization`): the load reads, allocates
    #: and initializes them no more.
    filled: frozenset[str] = frozenset()
    #: Fills, in the modules given, the ``filled`` tensors not filled yet. An engine calls
    #: it on each unit's modules just before sharding them, then on the whole model, so a
    #: rank holds one unit's filled tensors whole at a time (`fill_before_load` for a
    #: model no engine shards); ``None`` when ``filled`` is empty.
    fill_before_sharding: Callable[[Sequence[nn.Module]], None] | None = None

    def fill_before_load(self, model: nn.Module) -> None:
        """Fill what `fill_before_sharding` has left in ``model`` (all of it when no engine
        called it)."""
        if self.fill_before_sharding is not None:
            self.fill_before_sharding([model])

    @property
    def weights(self) -> Path:
        """Where the weights are (`CheckpointFormat.weights_folder`)."""
        return self.format.weights_folder(self.path)
