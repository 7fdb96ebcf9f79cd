"""`load`: fill a (possibly sharded, possibly meta) model from a checkpoint on disk.

Sources: one ``.safetensors`` file; a directory of safetensors shards with an index
(``model.safetensors.index.json``) or a single ``model.safetensors``, or as the
checkpoint's format names them (`annot.checkpoint_io.formats`: diffusers' names, a
pipeline's component folder); a torch distributed checkpoint (a directory with ``.metadata``; read when annot
committed it, a training state, or when asked: ``dcp=True``). Each rank reads only
the rows of its own shards (positioned reads): an FSDP2 DTensor's rows, or the rows
covering the flat range an FSDP1 shard or a DeepSpeed ZeRO-3 partition holds. It
converts the dtype on the way in and loads a tied parameter once. The format says how
the checkpoint's keys become the model's names; a tensor it builds from several keys (a
fused mixture-of-experts ``gate_up_proj`` from one key per expert, transformers') is read
the same way, each block from the source blocks it is made of
(`annot.checkpoint_io.converted`; docs/design.md, pitfall 42). The reads are planned
first and then run together (`annot.checkpoint_io.read_queue`: large pieces on a few
threads, straight into the destination; through staging buffers for a conversion or a
GPU). With ``mmap=True`` a
whole tensor's or an FSDP2 shard's rows are mapped from the file instead of read
(copy-on-write: docs/design.md, pitfall 28).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from annot._progress import Progress
from annot.checkpoint_io import commit
from annot.checkpoint_io.converted import Conversions, read_flat
from annot.checkpoint_io.converted import read_into as read_converted_into
from annot.checkpoint_io.formats import PLAIN, CheckpointFormat, CheckpointSource, FileNames
from annot.checkpoint_io.read_queue import ReadQueue
from annot.checkpoint_io.safetensors_file import SafetensorsFile
from annot.errors import CheckpointError
from annot.meta.deferred import deferred_init_of
from annot.meta.layout import WHOLE, Block, FlatPart, ShardLayout, dtensor_block, local
from annot.meta.materialization import materialize, sharded_device

__all__ = ["CheckpointError", "LoadReport", "check_keys", "load", "load_logged", "load_source", "state_names",
           "WholeTensors"]

@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a `load` did: keys the model has but the checkpoint lacks, keys the checkpoint
    has but the model lacks, tensors filled and bytes this rank read."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    loaded: int
    bytes_read: int
    #: Bytes mapped from the files instead of read (``mmap=True``).
    bytes_mapped: int = 0


def load(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
         device: torch.device | str | None = None, layout: ShardLayout = WHOLE,
         dcp: bool = False, prefix: str | None = None, mmap: bool = False,
         format: CheckpointFormat = PLAIN, filled: Collection[str] = ()) -> LoadReport:
    """Load ``path`` into ``model`` in place and return a `LoadReport`.

    ``format`` (`annot.checkpoint_io.formats`) says where the weights are under ``path``,
    what its files are called and how its keys meet the model's names; the default is
    annot's own (the model's names, ``model.safetensors`` or shards with an index).
    `annot.load` chooses it for the model (transformers, PEFT, diffusers:
    `annot.formats`).

    ``strict=True`` raises `CheckpointError` listing missing and unexpected keys;
    ``strict=False`` loads what matches and reports the rest. A model still on the meta
    device is allocated first (``device``, default CPU or its mesh's device); its
    non-persistent buffers are recomputed from its `annot.meta_init` record, and the
    initialization of what the checkpoint provides is skipped. ``layout`` is where an
    engine that shards flattened parameters keeps them (`annot.load` asks the engines).

    A torch distributed checkpoint (DCP) is read when annot committed the folder (a
    training state of `annot.save_state`: its ``model.`` keys) or when ``dcp=True``
    asks for it: its ``.metadata`` is a pickle (docs/design.md, pitfall 17), read
    through an allowlist. ``prefix`` is what the checkpoint puts before the model's
    names (``"model."`` in torch's ``{"model": ..., "optim": ...}`` layout,
    ``"state_dict.model."`` for a Lightning module holding ``self.model``); ``None``
    finds it from the keys.

    ``mmap=True`` maps what it can instead of reading it (a model on the meta device,
    loaded on the CPU, whole or FSDP2-sharded, where the file's dtype is the model's):
    the load copies nothing, and a page is copied when first written (an optimizer
    step), for this process only. The files must then stay as they are while the model
    lives: rewriting one in place (not annot's saves, which write a new file and rename
    it) changes the values of weights not yet written, or kills the process (SIGBUS)
    if it shrinks (docs/design.md, pitfall 28). What cannot be mapped is read.

    ``filled`` names tensors that already hold their values from this checkpoint (a
    weight quantized on load, `annot.quantization`): they are neither read, nor
    allocated, nor initialized, nor reported missing.
    """
    path = format.weights_folder(Path(path))
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if mmap:
        _refuse_mapping(model, path, device, layout, dcp)
    if (path / ".metadata").is_file() and commit.is_committed(path):
        commit.require_committed(path)
        return _load_dcp(model, path, strict, layout, "model." if prefix is None else prefix)
    if dcp:
        return _load_dcp(model, path, strict, layout, prefix)
    if prefix is not None:
        raise CheckpointError(f"prefix={prefix!r} applies to torch distributed checkpoints: pass "
                              "dcp=True to read one")
    if (path / ".metadata").is_file() and not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} holds a torch distributed checkpoint; its .metadata is a pickle, which annot "
            "reads only when asked: pass dcp=True if you trust the folder (and prefix='model.' "
            "or another if its keys carry one)")
    if filled and (dcp or (path / ".metadata").is_file()):
        raise CheckpointError(f"{path}: tensors filled before the load (quantized) are read from "
                              "safetensors files only")
    match = _match(model, path, layout, format, frozenset(filled))
    missing, unexpected, groups = match.missing, match.unexpected, match.groups
    if strict and (missing or unexpected):
        raise CheckpointError(_mismatch(path, missing, unexpected))
    _refuse_incompatible(match, layout)
    provided = {n for group in groups if any(match.provides(m) for m in group) for n in group}
    mapped = _map_provided(model, groups, match, layout) if mmap else None
    _allocate(model, device, skip=provided | set(filled), layout=layout, mapped=mapped)
    mapped = mapped or {}
    loaded, read = _fill_from_safetensors(model, groups, match, layout, skip=set(mapped))
    converted, converted_read = _fill_converted(model, groups, match, layout)
    loaded, read = loaded + converted, read + converted_read
    mapped_groups = {id(value): local(value).nbytes for value in mapped.values()}
    return LoadReport(tuple(missing), tuple(unexpected), loaded + len(mapped_groups), read,
                      sum(mapped_groups.values()))


def _refuse_mapping(model: nn.Module, path: Path, device: torch.device | str | None,
                    layout: ShardLayout, dcp: bool) -> None:
    """Say why ``mmap=True`` cannot apply, before anything is allocated."""
    why = None
    if dcp or ((path / ".metadata").is_file() and commit.is_committed(path)):
        why = "a torch distributed checkpoint is read through torch's reader"
    elif layout.parts or layout.wrapper_names:
        why = (f"{layout.engine or 'this engine'} keeps flattened parameters of its own, "
               "which cannot point at the file")
    elif device is not None and torch.device(device).type != "cpu":
        why = f"the weights go to {device}, so they are copied anyway"
    elif (mesh_device := sharded_device(model)) is not None and mesh_device.type != "cpu":
        why = f"the model's device mesh is on {mesh_device.type}, so the weights are copied anyway"
    elif not any(local(t).is_meta for t in [*model.parameters(), *model.buffers()]):
        # Parameters that already exist may be referenced (an optimizer, an engine's
        # state): replacing them would leave those holding the old ones.
        why = "the model already has storage; mapping replaces parameters, so it needs a model on the meta device"
    if why is not None:
        raise CheckpointError(f"mmap=True cannot load {path}: {why}. Load without mmap.")


def load_logged(model: nn.Module, path: str | os.PathLike[str], device: torch.device | None,
                layout: ShardLayout = WHOLE, mmap: bool = False,
                format: CheckpointFormat = PLAIN, filled: Collection[str] = ()) -> None:
    """`annot.load` without strictness; what did not match is logged, not silent."""
    report = load(model, path, strict=False, device=device, layout=layout, mmap=mmap, format=format,
                  filled=filled)
    for what, keys in (("kept their initialization (not in the checkpoint)", report.missing),
                       ("were ignored (not in the model)", report.unexpected)):
        if keys:
            shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            logging.getLogger("annot").warning("loading %s: %s %s", path, shown, what)


def load_source(model: nn.Module, source: CheckpointSource, device: torch.device | None,
                layout: ShardLayout = WHOLE, mmap: bool = False) -> None:
    """`load_logged` of ``source`` with its format, after filling what it fills before a
    load (`CheckpointSource.fill_before_load`) and leaving those tensors alone."""
    source.fill_before_load(model)
    load_logged(model, source.path, device, layout, mmap, source.format, source.filled)


@dataclasses.dataclass(frozen=True)
class _Match:
    """How a safetensors checkpoint's keys meet a model's state names."""

    missing: list[str]  # one name per tied group the checkpoint lacks
    unexpected: list[str]
    groups: list[list[str]]  # names sharing one tensor
    available: dict[str, Path]  # model name -> file holding it
    file_key: dict[str, str]  # model name -> its key in that file
    files: dict[Path, SafetensorsFile]  # every file, its header checked
    names: dict[str, torch.Tensor]  # `state_names` when matched (before any allocation)
    # Model tensors the format builds from several keys (transformers' fused MoE
    # experts), read block by block (`annot.checkpoint_io.converted`), and the file of
    # each key used.
    converted: Conversions = dataclasses.field(default_factory=Conversions)
    converted_files: dict[str, Path] = dataclasses.field(default_factory=dict)

    def provides(self, name: str) -> bool:
        return name in self.available or name in self.converted.targets


def _match(model: nn.Module, path: Path, layout: ShardLayout, format: CheckpointFormat,
           filled: frozenset[str] = frozenset()) -> _Match:
    """Match the checkpoint at ``path`` (the weights folder or file) with ``model``, reading
    only the files' headers; ``format`` says how its keys become the model's names.
    Groups holding a ``filled`` name are left out (their values are in already)."""
    files = _safetensors_files(path, format.files)
    names = state_names(model, layout)
    where = {key: file for file, handle in files.items() for key in handle.keys()}
    sources = {key: (files[file].shape(key), files[file].dtype(key)) for key, file in where.items()}
    keys = format.key_map(layout.bare_model(model), sources, names)
    converted = keys.conversions
    available: dict[str, Path] = {}
    file_key: dict[str, str] = {}
    for key, file in where.items():
        if key in converted.consumed:
            continue
        name = keys.rename(key) if keys.rename is not None else key
        available[name] = file
        file_key[name] = key
    for name, others in keys.copies.items():
        # A module copy the checkpoint names once (PEFT's modules_to_save; a tied head
        # under the embedding's key) takes that key too, so it is loaded rather than left
        # to its initialization (strict=False trained a random head: pitfall 54).
        source = next((other for other in others if other in available), None)
        if name not in available and source is not None:
            available[name], file_key[name] = available[source], file_key[source]
    groups = [group for group in _tied_groups(model, names, layout) if not filled.intersection(group)]
    missing = [group[0] for group in groups
               if not any(n in available or n in converted.targets for n in group)]
    unexpected = sorted(set(available) - set(names))
    return _Match(missing, unexpected, groups, available, file_key, files, names, converted,
                  {key: where[key] for key in converted.consumed})


class WholeTensors:
    """Tensors of the unsharded ``model`` read whole from the safetensors checkpoint at
    ``path``: the headers are matched once, here (`CheckpointError` for any of ``names``
    the checkpoint has under no key of its own, missing or built from several keys, or
    with another shape), and `read` reads one tensor at a time, in the model tensor's
    dtype, whenever it is called (later, after other units were sharded, too)."""

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], names: Collection[str], *,
                 format: CheckpointFormat = PLAIN) -> None:
        match = _match(model, format.weights_folder(Path(path)), WHOLE, format)
        self._where: dict[str, tuple[SafetensorsFile, str, torch.dtype]] = {}
        for name in names:
            if name not in match.available:
                raise CheckpointError(f"{path}: {name} is not one tensor of the checkpoint, so it "
                                      "cannot be read whole (missing, or built from several keys)")
            key, handle = match.file_key[name], match.files[match.available[name]]
            _compare(f"{match.available[name]}: {key}", handle.shape(key), handle.dtype(key), name,
                     match.names[name], WHOLE)
            self._where[name] = (handle, key, match.names[name].dtype)

    def read(self, name: str) -> torch.Tensor:
        """``name``'s tensor, whole, in the model's dtype (one of the ``names`` given)."""
        handle, key, dtype = self._where[name]
        return handle.read(key).to(dtype)


def _refuse_incompatible(match: _Match, layout: ShardLayout) -> None:
    """Compare every tensor the checkpoint provides with the model's, from the headers
    alone, before anything is allocated (docs/design.md, pitfall 17): the shape must be
    equal, and the dtype equal or both floating point (a cast between float types is a
    conversion; anything else would reinterpret values)."""
    for name, file in match.available.items():
        if name in match.names:
            key, handle = match.file_key[name], match.files[file]
            _compare(f"{file}: {key}", handle.shape(key), handle.dtype(key), name,
                     match.names[name], layout)
    for name, node in match.converted.targets.items():
        first = node.sources()[0]
        _compare(f"{match.converted_files[first]}: {first} and the keys converted with it", node.shape,
                 node.dtype, name, match.names[name], layout)


def _compare(where: str, shape: tuple[int, ...], dtype: torch.dtype, name: str, target: torch.Tensor,
             layout: ShardLayout) -> None:
    parts = layout.parts.get(id(target))
    model_shape = parts[0].full_shape if parts else tuple(target.shape)
    if shape != model_shape:
        raise CheckpointError(f"{where}: checkpoint shape {shape} != model shape {model_shape} ({name})")
    wanted = local(target).dtype
    if dtype != wanted and not (dtype.is_floating_point and wanted.is_floating_point):
        raise CheckpointError(f"{where}: stored as {dtype}, the model's {name} is "
                              f"{wanted}; annot converts only between floating-point types")


def check_compatible(model: nn.Module, path: str | os.PathLike[str],
                     layout: ShardLayout = WHOLE, format: CheckpointFormat = PLAIN) -> None:
    """Raise `CheckpointError` when a tensor of the safetensors checkpoint at ``path``
    differs from ``model``'s in shape or in kind of dtype, reading only file headers
    (what is missing or extra is `load`'s business). ``auto_wrap(load_from=...)`` calls it
    before an engine allocates anything."""
    path = format.weights_folder(Path(path))
    if path.is_dir() and not any(path.glob("*.safetensors")):
        return  # a torch distributed checkpoint, or nothing: `load` says which
    if (path / ".metadata").is_file() and commit.is_committed(path):
        return  # an annot training state: read as DCP by `load`
    _refuse_incompatible(_match(model, path, layout, format), layout)


def check_keys(model: nn.Module, path: str | os.PathLike[str], layout: ShardLayout = WHOLE,
               format: CheckpointFormat = PLAIN) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys of the safetensors checkpoint at ``path`` (read as
    ``format``) against ``model``, reading only file headers (nothing allocated)."""
    match = _match(model, format.weights_folder(Path(path)), layout, format)
    return match.missing, match.unexpected


def _mismatch(path: Path, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{path} does not match the model"]
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:10])}"
                     f"{' ...' if len(unexpected) > 10 else ''}")
    return "; ".join(parts) + ". Pass strict=False to load what matches and get the rest reported."


def _safetensors_files(path: Path, names: FileNames) -> dict[Path, SafetensorsFile]:
    """The checkpoint's files (a file, or a folder's files as ``names`` calls them), each
    header checked (`SafetensorsFile`)."""
    if path.is_file():
        candidates = [path]
    elif names.index is not None and (path / names.index).is_file():
        candidates = _indexed_files(path, names.index)
    elif (path / names.single).is_file():
        candidates = [path / names.single]
    else:
        indexed = f", no {names.index}" if names.index is not None else ""
        raise CheckpointError(
            f"{path}: no {names.single}{indexed} and no torch distributed checkpoint (.metadata)")
    return {file: SafetensorsFile(file) for file in candidates}


def _indexed_files(folder: Path, index_name: str) -> list[Path]:
    """The files a HuggingFace index names, each checked to be a file inside ``folder``
    (no absolute path, no ``..``, no link leading out: docs/design.md, pitfall 17)."""
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: weight_map must be an object from tensor names to file names")
    root = folder.resolve()
    files = []
    for name in sorted(set(weight_map.values())):
        file = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not file.resolve().is_relative_to(root):
            raise CheckpointError(f"{index}: {name!r} is outside {folder}; an index may only name "
                                  "files in its own folder")
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the index but missing")
        files.append(file)
    return files


def state_names(model: nn.Module, layout: ShardLayout = WHOLE) -> dict[str, torch.Tensor]:
    """Every name a state dict of the bare ``model`` has (tied names included), with its
    tensor; an engine's wrapper levels (``layout``) are left out of the names."""
    out: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        path = layout.clean(path)
        prefix = f"{path}." if path else ""
        for name, param in module._parameters.items():
            if param is not None:
                out[prefix + name] = param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buffer
    return out


def _tied_groups(model: nn.Module, names: dict[str, torch.Tensor],
                 layout: ShardLayout = WHOLE) -> list[list[str]]:
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, tensor in names.items():
        by_tensor[id(tensor)].append(name)
    record = deferred_init_of(layout.bare_model(model))
    if record is not None:  # after to_empty, ties are known by the record, not by identity
        by_ref: dict[int, list[str]] = defaultdict(list)
        for name in names:
            by_ref[record.tensors.get(name, -1 - len(by_ref))].append(name)
        return list(by_ref.values())
    return list(by_tensor.values())


def _allocate(model: nn.Module, device: torch.device | str | None, skip: set[str],
              layout: ShardLayout, mapped: dict[str, torch.Tensor] | None = None) -> None:
    """Give a meta model storage (or, after an engine allocated it unit by unit, values)
    for what the checkpoint does not provide; ``skip`` names what it does. ``mapped``
    tensors (mmap) go in first, with empty ones for the rest, so the record's replay has
    nothing left to allocate: allocating every shard only for the mapping to replace it
    took ~0.1 s of a warm 2-rank 1.1B load."""
    tensors = list(model.parameters()) + list(model.buffers())
    record = deferred_init_of(layout.bare_model(model))
    if not any(local(t).is_meta for t in tensors) and not (record is not None and record.pending):
        if mapped:  # `_refuse_mapping` keeps this from happening: never drop what was mapped
            raise CheckpointError("mmap=True maps into a model on the meta device; this one has storage")
        return
    if record is not None:
        if mapped is not None:
            _give_storage(model, layout, mapped)
        # The replay may still compute a mapped group (a buffer derived from it): never
        # write its initial values into the file's pages.
        materialize(model, device=device, skip=skip, layout=layout, keep=set(mapped or ()))
        return
    meta_buffers = [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name in module._non_persistent_buffers_set
        if module._buffers.get(name) is not None and module._buffers[name].is_meta
    ]
    if meta_buffers:
        raise CheckpointError(
            f"non-persistent buffers {', '.join(meta_buffers[:6])} are on the meta device and no "
            "checkpoint holds them: build the model under annot.meta_init() so they can be recomputed")
    raise CheckpointError(
        "the model is on the meta device and was not built under annot.meta_init(): build it "
        "there (or materialize it) before loading")


def _block(target: torch.Tensor) -> Block | None:
    """The block of the full tensor this rank holds; ``None`` for a plain tensor."""
    try:
        return dtensor_block(target)
    except ValueError as exc:
        raise CheckpointError(f"cannot load into this rank's part: {exc}") from None


def _fill_converted(model: nn.Module, groups: list[list[str]], match: _Match,
                    layout: ShardLayout) -> tuple[int, int]:
    """Fill the tensors transformers' converters build (fused MoE experts) with the block
    this rank keeps, reading only the source blocks it is made of: an FSDP2 shard's rows
    (experts ``[a, b)`` of a stacked tensor: those experts' keys only), a tensor-parallel
    block, the rows covering a flat shard's range (FSDP1, ZeRO-3), or the whole tensor.
    Returns (tensors, bytes read)."""
    if not match.converted.targets:
        return 0, 0
    names = state_names(model, layout)
    read = 0

    def reader(key: str, start: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal read
        value = match.files[match.converted_files[key]].read_block(key, start, shape)
        read += value.numel() * value.element_size()
        return value

    loaded = 0
    with torch.no_grad():
        for group in groups:
            source = next((n for n in group if n in match.converted.targets), None)
            if source is None or any(n in match.available for n in group):
                continue  # not converted, or read as it is under a tied name
            node, target = match.converted.targets[source], names[group[0]]
            parts = layout.parts.get(id(target))
            if parts is not None:  # tied names share the parameter and its parts
                for part in parts:
                    if part.stop > part.start:
                        part.destination[:part.stop - part.start].copy_(
                            read_flat(node, part.start, part.stop, reader))
            else:
                block = _block(target)
                start, shape = (block.start, block.shape) if block is not None else ((0,) * len(node.shape), node.shape)
                first, *others = {id(t): t for t in (local(names[n]) for n in group)}.values()
                read_converted_into(node, start, shape, reader, first)  # straight into the parameter
                for other in others:
                    if other.numel():
                        other.copy_(first)
            loaded += 1
    return loaded, read


def _fill_from_safetensors(model: nn.Module, groups: list[list[str]], match: _Match,
                           layout: ShardLayout, skip: set[str]) -> tuple[int, int]:
    """Read every group the checkpoint provides but ``skip`` (mapped already); returns
    (tensors, bytes read)."""
    names = state_names(model, layout)
    parts = layout.parts
    loaded = read = 0
    items = _provided_by_file(groups, match, skip)
    total = sum(len(group_items) for group_items in items.values())
    # Every read is planned first and then done at once, in large pieces on a few
    # threads (`ReadQueue`): one thread per rank did not reach the disk's bandwidth cold
    # (issue #32).
    queue = ReadQueue()
    with torch.no_grad(), Progress("loading", total) as progress:
        for file, group_items in items.items():
            handle = match.files[file]
            for source, group in group_items:
                target = names[group[0]]
                target_parts = parts.get(id(target))
                if target_parts is not None:  # tied names share the parameter and its parts
                    read += _fill_flat_parts(handle, source, target_parts, queue)
                else:
                    read += _fill_tensor(handle, source, [local(names[name]) for name in group],
                                         _block(target), queue)
                loaded += 1
                progress.advance()
        queue.run()
    return loaded, read


def _provided_by_file(groups: list[list[str]], match: _Match,
                      skip: Collection[str] = ()) -> dict[Path, list[tuple[str, list[str]]]]:
    """The groups the checkpoint provides (but ``skip``), by file, each with its key there."""
    by_file: dict[Path, list[tuple[str, list[str]]]] = defaultdict(list)
    for group in groups:
        source = next((n for n in group if n in match.available), None)
        if source is not None and group[0] not in skip:
            by_file[match.available[source]].append((match.file_key[source], group))
    return by_file


def _map_provided(model: nn.Module, groups: list[list[str]], match: _Match,
                  layout: ShardLayout) -> dict[str, torch.Tensor]:
    """Every provided tensor that can be mapped from its file, by name (tied names share
    one), built on the model's meta tensors: their kind, mesh and this rank's block."""
    names = state_names(model, layout)
    mapped: dict[str, torch.Tensor] = {}
    for file, group_items in _provided_by_file(groups, match).items():
        handle = match.files[file]
        for source, group in group_items:
            target = names[group[0]]
            replacement = _mapped(handle, source, target, _block(target))
            if replacement is not None:
                mapped.update(dict.fromkeys(group, replacement))
    return mapped


def _mapped(handle: SafetensorsFile, source: str, target: torch.Tensor,
            block: Block | None) -> torch.Tensor | None:
    """A replacement for ``target`` (of which this rank keeps ``block``) whose storage is
    mapped from the file: the same kind of tensor (Parameter, DTensor on the same mesh and placements),
    shape and strides. ``None`` when it must be read: another dtype (converted on
    reading), columns of a tensor-parallel split, a layout the rows do not have."""
    part = local(target)
    full_shape = handle.shape(source)
    if handle.dtype(source) != part.dtype or part.device.type not in ("cpu", "meta") or not part.numel():
        return None
    if block is None or not full_shape:
        rows = (0, full_shape[0] if full_shape else 1)
    elif block.rows_only(full_shape):
        rows = (block.start[0], block.start[0] + block.shape[0])
    else:
        return None
    value = handle.map_rows(source, *rows)
    if value is None or value.shape != part.shape or value.stride() != part.stride():
        return None
    return _like(target, value)


def _like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's part) as the same kind of tensor as ``target``: a DTensor
    on its mesh and placements, a Parameter with its ``requires_grad``."""
    if isinstance(target, DTensor):
        # The target's own spec (mesh, placements, global shape, stride, dtype), as FSDP2
        # builds its shards: `DTensor.from_local` runs an autograd function a load needs
        # no graph from, 4x the time (0.020 against 0.0055 s for 201 tensors, measured).
        is_param = isinstance(target, nn.Parameter)
        value = DTensor(value, target._spec, requires_grad=target.requires_grad and is_param)
        if is_param:
            # What `nn.Parameter` makes of a tensor subclass, without its `detach()`, which
            # goes through DTensor's dispatch: the new DTensor has no graph to cut (201
            # tensors: 1.6 against 6.7 ms, measured). The flag is how torch marks it.
            value._is_param = True
        return value
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
    return value


def _give_storage(model: nn.Module, layout: ShardLayout, mapped: dict[str, torch.Tensor]) -> None:
    """Put ``mapped`` in the model, and an empty CPU tensor of the same kind for every
    other tensor still on the meta device (the record's replay and the reads fill them).
    One new tensor per old one: tied names, and a non-persistent buffer that is a
    persistent tensor under another name, stay one tensor."""
    names = state_names(model, layout)
    new = {id(names[name]): value for name, value in mapped.items()}

    def replacement(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in new:
            part = local(tensor)
            empty = torch.empty_strided(part.shape, part.stride(), dtype=part.dtype, device="cpu")
            new[id(tensor)] = _like(tensor, empty)
        return new[id(tensor)]

    buffers = [(module, name, buffer) for module in model.modules()
               for name in module._non_persistent_buffers_set
               if (buffer := module._buffers.get(name)) is not None and buffer.is_meta]
    _assign(model, {name: replacement(tensor) for name, tensor in names.items()
                    if name in mapped or local(tensor).is_meta})
    for module, name, buffer in buffers:
        module._buffers[name] = replacement(buffer)


def _assign(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put ``values`` in the model in place of its tensors of those names (tied names
    share one object). Through ``load_state_dict(assign=True)``: its hooks are how an
    engine learns its parameters changed (FSDP2 re-derives its shard buffers from them)."""
    if not values:
        return
    result = model.load_state_dict(values, strict=False, assign=True)
    if result.unexpected_keys:
        raise CheckpointError(f"mapped tensors the model does not take: {result.unexpected_keys[:6]}")


def _direct(handle: SafetensorsFile, source: str, destination: torch.Tensor) -> bool:
    """Whether the file's bytes can go straight into ``destination`` (same dtype, one
    contiguous CPU block): one read, no buffer, no second copy."""
    return (destination.dtype == handle.dtype(source) and destination.is_contiguous()
            and destination.device.type == "cpu")


def _queue_range(queue: ReadQueue, handle: SafetensorsFile, source: str,
                 destination: torch.Tensor, first: int) -> int | None:
    """Queue filling ``destination`` with the elements of ``source`` from flat index
    ``first`` on: straight into it (`_direct`), or through the staging buffers (another
    dtype, another device). ``None`` when neither applies (a non-contiguous destination);
    else the bytes queued."""
    label = f"{handle.path}: {source}"
    offset = handle.offset_of(source, first, destination.numel())
    if _direct(handle, source, destination):
        return queue.direct(handle.path, label, offset, destination)
    if destination.is_contiguous():
        return queue.staged(handle.path, label, offset, destination, handle.dtype(source))
    return None


def _fill_tensor(handle: SafetensorsFile, source: str, targets: list[torch.Tensor],
                 block: Block | None, queue: ReadQueue) -> int:
    """Fill ``targets`` (one tensor, or tied names' distinct copies) with ``block`` of
    ``source`` (all of it when ``None``): queued on ``queue`` where the bytes form one
    range, else read now. Returns the bytes read or queued."""
    first = targets[0]
    if not first.numel():
        return 0
    full_shape = handle.shape(source)
    rows = None if block is None or not full_shape else (block.start[0], block.start[0] + block.shape[0])
    if block is not None and full_shape and not block.rows_only(full_shape):
        # Columns too (a row-wise tensor-parallel shard): only the block's bytes are read.
        value = handle.read_block(source, block.start, block.shape)
        for target in _distinct(targets):
            target.copy_(value)
        return value.numel() * value.element_size()
    start = (rows[0] if rows is not None else 0) * math.prod(full_shape[1:])
    read = 0
    for target in _distinct(targets):  # tied names may be distinct objects (to_empty): each read
        queued = _queue_range(queue, handle, source, target, start)
        if queued is None:  # a layout that needs a copy
            value = handle.read(source, *rows) if rows is not None else handle.read(source)
            target.copy_(value)
            queued = value.numel() * value.element_size()
        read += queued
    return read


def _distinct(targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """``targets`` with storage, each object once."""
    out: list[torch.Tensor] = []
    for target in targets:
        if target.numel() and not any(target is seen for seen in out):
            out.append(target)
    return out


def _fill_flat_parts(handle: SafetensorsFile, source: str, parts: list[FlatPart],
                     queue: ReadQueue) -> int:
    """Queue reading the elements each flat part of ``source`` holds into it (the exact
    byte range; converted through the staging buffers when the dtypes differ); returns
    the bytes queued or read."""
    read = 0
    for part in parts:
        if part.stop <= part.start:
            continue
        destination = part.destination[:part.stop - part.start]
        queued = _queue_range(queue, handle, source, destination, part.start)
        if queued is not None:
            read += queued
            continue
        per_row = math.prod(part.full_shape[1:])
        if part.full_shape:
            first, last = part.start // per_row, -(-part.stop // per_row)
            rows = handle.read(source, first, last).reshape(-1)
            offset = first * per_row
        else:  # a scalar
            rows, offset = handle.read(source).reshape(-1), 0
        read += rows.numel() * rows.element_size()
        destination.copy_(rows[part.start - offset:part.stop - offset])
    return read


def _load_dcp(model: nn.Module, path: Path, strict: bool, layout: ShardLayout,
              prefix: str | None) -> LoadReport:
    """Read the model's state out of the DCP folder ``path``, keys ``prefix + name``:
    each rank reads what it keeps (a DTensor's rows, a flat shard's range, a whole
    tensor), through torch's resharding reads."""
    import torch.distributed.checkpoint as dcp

    from annot.checkpoint_io.dcp_metadata import SafeFileSystemReader, read_metadata
    from annot.checkpoint_io.flat_chunks import FlatChunks

    _allocate(model, None, skip=set(state_names(model, layout)), layout=layout)
    names = state_names(model, layout)
    keys = {k for k, v in read_metadata(path).state_dict_metadata.items() if hasattr(v, "chunks")}
    if prefix is None:
        prefix = _dcp_prefix(set(names), keys)
    groups = _tied_groups(model, names, layout)
    chosen = {group[0]: next((n for n in group if prefix + n in keys), None) for group in groups}
    missing = [name for name, source in chosen.items() if source is None]
    unexpected = sorted(k[len(prefix):] for k in keys if k.startswith(prefix) and k[len(prefix):] not in names)
    if strict and (missing or unexpected):
        raise CheckpointError(_mismatch(path, missing, unexpected)
                              + (f" (keys read under the prefix {prefix!r})" if prefix else ""))
    # One read per destination a tensor has here (a ZeRO-3 persistent parameter keeps its
    # partition and its whole value: two), each key once per read.
    reads: list[dict[str, torch.Tensor]] = [{}]
    read = loaded = 0
    for group in groups:
        source = chosen[group[0]]
        if source is None:
            continue
        target = names[group[0]]
        parts = layout.parts.get(id(target))
        if parts:
            while len(reads) < len(parts):
                reads.append({})
            for i, part in enumerate(parts):
                reads[i][prefix + source] = FlatChunks(part.full_shape, target.dtype,
                                                       [(part.start, part.stop, part.destination)])
                read += max(part.stop - part.start, 0) * target.element_size()
        else:
            reads[0][prefix + source] = target.data if isinstance(target, nn.Parameter) else target
            read += local(target).numel() * local(target).element_size()
        loaded += 1
    with torch.no_grad():
        for state in reads:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    return LoadReport(tuple(missing), tuple(unexpected), loaded, read)


def _dcp_prefix(names: set[str], keys: set[str]) -> str:
    """What the checkpoint's keys put before the model's names: the prefix under which
    most of them are found ("" if all are there as they are)."""
    if names <= keys:
        return ""
    counts: dict[str, int] = defaultdict(int)
    for key in keys:
        for i, char in enumerate(key):
            if char == "." and key[i + 1:] in names:
                counts[key[:i + 1]] += 1
    if not counts:
        return ""
    return max(counts, key=lambda p: (counts[p], -len(p)))
