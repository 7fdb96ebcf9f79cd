"""`materialize`: give a `meta_init` model real values, unit by unit, shard by shard.

The tape recorded at construction is replayed on the CPU from the recorded random
state, in order (so the random stream, and so every value, is exactly eager
construction's). A tensor's storage is allocated when an operation first produces it
and released right after its last use on the tape; at that moment each parameter or
buffer living in it is copied into the model: whole for a plain module, only this
rank's share for a sharded one (an FSDP2 DTensor's slice; the part of a flattened
parameter FSDP1 or DeepSpeed ZeRO-3 keeps on this rank). Peak memory is therefore the model's
shard plus about one parameter, whatever the number of ranks, and the result does not
depend on the number of ranks.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from annot._progress import Progress
from annot.meta.deferred import (
    UNINITIALIZED,
    DeferredInit,
    DeferredInitError,
    Ref,
    deferred_init_of,
    leaves,
    map_leaves,
)
from annot.meta.layout import WHOLE, FlatPart, ShardLayout, dtensor_block, local
from annot.meta.tensor_attributes import map_tensor_attributes, tensor_attributes
from annot.module_state import module_state, peek_state

__all__ = ["ReplayStats", "materialize", "replay_stats"]

def replay_stats(model: nn.Module) -> ReplayStats | None:
    """What the last `materialize` of ``model`` counted (peak bytes of full tensors)."""
    state = peek_state(model)
    return state.replay_stats if state is not None else None


def materialize(model: nn.Module, *, device: torch.device | str | None = None,
                progress: bool | None = None, skip: set[str] | frozenset[str] = frozenset(),
                layout: ShardLayout = WHOLE, keep: set[str] | frozenset[str] = frozenset()) -> nn.Module:
    """Allocate ``model``'s tensors on ``device`` (default: CPU, or the device its sharded
    parameters were placed on) and fill them from the `meta_init` record. Returns the model.

    Raises `DeferredInitError` when the model was not built under `annot.meta_init`,
    when a module owns parameters nothing initializes, or when a tensor is left on the
    meta device. The caller's random-number state is left as it was. ``skip`` names
    parameters the caller fills itself (a checkpoint load): their initialization is not
    replayed at all, unless something kept is computed from it, and then it is written
    too, except into ``keep``: tensors that already hold their values (mapped from a
    file; what depends on them is still computed from their initial values, as eager
    construction does). Random numbers the skipped initialization would have drawn are
    not drawn, so a tensor initialized after it gets values from its initialization but
    not eager's exact ones (docs/design.md, pitfall 30). ``layout`` is where an engine
    that shards flattened parameters keeps them on this rank (`annot.materialize` asks
    the engines; DTensors need none).
    """
    record = deferred_init_of(layout.bare_model(model))
    if record is None:
        raise DeferredInitError(
            f"{type(model).__name__} was not built under annot.meta_init(), so there is no "
            "record of how to initialize it: build it with `with annot.meta_init(): ...` "
            "or annot.build(cls, ...)."
        )
    missing = [n for n in record.uninitialized() if n not in skip]
    if missing:
        paths = sorted({record.module_of[n] for n in missing})
        modules = [_module_named(model, path) for path in paths]
        raise DeferredInitError(
            f"no init path for {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}: "
            f"module(s) {', '.join(modules)} create parameters that nothing initializes. "
            "Define reset_parameters() on the module, initialize them in __init__, or call "
            "annot.register_init(ModuleClass, fn)."
        )
    refs = _op_refs(record)
    skipped_groups = _skippable({record.group_of[record.tensors[n]] for n in skip}, record, refs)
    _refuse_stranded_views(record, skip, skipped_groups)
    targets = _targets(model, record)
    if any(local(t).is_meta for t in targets.values()):
        # to_empty allocates only local shards for FSDP2 modules, but gives each module's
        # visit of a tied parameter its own new Parameter: tie them again right after.
        _to_empty(model, device or sharded_device(model) or "cpu")
        _retie(model, record)
        targets = _targets(model, record)
    # A tied name skipped means its twin is filled from the checkpoint too.
    fill = {n: t for n, t in targets.items()
            if record.group_of[record.tensors[n]] not in skipped_groups and n not in keep}
    attributes = _attribute_targets(model, record, layout, device or sharded_device(model) or "cpu")
    stats = _replay(record, refs, {**fill, **attributes}, progress, skipped_groups, layout.parts)
    module_state(model).replay_stats = stats
    record.pending = False
    leftover = [n for n, t in _targets(model, record).items() if local(t).is_meta]
    leftover += [n for n, t in tensor_attributes(model).items() if layout.clean(n) in record.attributes and t.is_meta]
    if leftover:
        named = [f"{n} ({_module_named(model, record.module_of[n])})" for n in leftover]
        raise DeferredInitError(f"still on the meta device after materializing: {', '.join(named)}")
    return model


def _attribute_targets(model: nn.Module, record: DeferredInit, layout: ShardLayout,
                       device: torch.device | str) -> dict[str, torch.Tensor]:
    """Recorded plain tensor attributes (`annot.meta.tensor_attributes`) still on the
    meta device, each replaced in its module by an empty whole tensor on ``device``:
    the replay's targets by recorded name. Every rank computes them whole, as eager
    construction does; no engine shards them."""
    made: dict[str, torch.Tensor] = {}

    def allocate(name: str, tensor: torch.Tensor) -> torch.Tensor:
        recorded = layout.clean(name)
        if recorded not in record.attributes or not tensor.is_meta:
            return tensor
        made[recorded] = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
        return made[recorded]

    if record.attributes:
        map_tensor_attributes(model, allocate)
    return made


def _to_empty(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device=device)``: every tensor replaced by an empty one of the same
    kind, shape, strides and dtype on ``device``, through the same ``nn.Module._apply``
    (so an engine's override still runs: FSDP2 re-registers and pads its shards there).
    Only how the empty twins of the usual tensors are made differs, for speed: a
    DTensor's is its local part's twin wrapped under the DTensor's own spec, as
    ``empty_like`` of the DTensor returns; a plain contiguous tensor's is a plain
    ``empty`` (the strides ``empty_like`` keeps for it). Any other tensor (another
    subclass, another layout) gets ``empty_like``, as in ``to_empty``. A tensor that is
    not on the meta device is kept as it is."""
    target = torch.device(device)

    def plain(tensor: torch.Tensor) -> bool:
        return (type(tensor) in (torch.Tensor, nn.Parameter) and tensor.layout == torch.strided
                and tensor.is_contiguous())

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if not local(tensor).is_meta:
            # It holds its values already (a weight quantized on load): unlike torch's
            # to_empty, never replace them by garbage.
            return tensor
        if type(tensor) is DTensor and plain(tensor._local_tensor):
            # empty_like of a DTensor goes through DTensor's dispatch, which propagates
            # the sharding on fake tensors the first time it meets each shape: most of
            # the 0.13-0.18 s to_empty took in a warm 2-rank load of the 0.66B Llama
            # (issue #42, profiled). requires_grad as empty_like gives it under
            # _apply's no_grad: _apply makes the Parameter, with the old one's flag.
            part = tensor._local_tensor
            return DTensor(torch.empty(part.shape, dtype=part.dtype, device=target), tensor._spec,
                           requires_grad=False)
        if plain(tensor):
            # empty_like of a meta tensor runs torch's Python reference (the strides
            # of every memory format): 0.3 ms a tensor, profiled.
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=target)
        return torch.empty_like(tensor, device=target)

    model._apply(empty)


def _refuse_stranded_views(record: DeferredInit, skip: set[str] | frozenset[str],
                           skipped_groups: set[int]) -> None:
    """A tensor that is another view of a skipped one's storage (a non-persistent buffer
    made as ``self.weight.detach()``) would be neither replayed nor filled by the caller:
    allocation gives each name its own storage, so the view no longer sees the fill."""
    filled = {record.tensors[n] for n in skip}
    stranded = [n for n, ref in record.tensors.items()
                if n not in skip and ref not in filled and record.group_of[ref] in skipped_groups]
    if stranded:
        raise DeferredInitError(
            f"{', '.join(stranded[:6])} share storage with tensors the checkpoint fills "
            "(a view or a detach of one), and allocating the model gives every tensor storage "
            "of its own, so they would keep no value: make them separate tensors (or "
            "recompute them after loading)")


def _owners(model: nn.Module, record: DeferredInit) -> Iterator[tuple[str, int, nn.Module, str]]:
    """Each recorded name with its tape index, the module holding it and its name there."""
    # One walk for every name: `get_submodule` per name took 4 ms for a 1.1B Llama's 201.
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, ref in record.tensors.items():
        module_path, _, leaf = name.rpartition(".")
        module = modules[module_path] if module_path in modules else model.get_submodule(module_path)
        yield name, ref, module, leaf


def _module_named(model: nn.Module, path: str) -> str:
    """``path (Class)`` for an error message: a module path alone (``1``, ``layers.3``)
    rarely says which code to fix, its class does (issue #33)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:  # the tree changed since construction: the path is all we know
        return path or "(root)"
    return f"{path or '(root)'} ({type(module).__name__})"


def _targets(model: nn.Module, record: DeferredInit) -> dict[str, torch.Tensor]:
    out = {}
    for name, _, module, leaf in _owners(model, record):
        tensor: torch.Tensor | None = module._parameters.get(leaf)
        if tensor is None:
            tensor = module._buffers[leaf]
        if tensor is None:
            raise DeferredInitError(
                f"{name} is None now in module {_module_named(model, record.module_of[name])}, but "
                "was a tensor when the model was built under annot.meta_init(): give it a tensor "
                "again, or build the model without it")
        out[name] = tensor
    return out


_OpRefs = tuple[list[Ref], list[Any]]


def _op_refs(record: DeferredInit) -> list[_OpRefs]:
    """Each operation's tensor inputs (the `Ref`s of its args and kwargs, in order) and
    its flattened outputs, flattened once: flattening every operation again in each pass
    below took about 0.3 s of a 1.1B Llama's load (profiled)."""
    return [([x for x in leaves((op.args, op.kwargs)) if isinstance(x, Ref)], list(leaves(op.out)))
            for op in record.ops]


def _touched(op_refs: _OpRefs) -> list[Ref]:
    inputs, outputs = op_refs
    return inputs + [r for r in outputs if isinstance(r, Ref)]


def _skippable(groups: set[int], record: DeferredInit, refs: list[_OpRefs]) -> set[int]:
    """The groups whose initialization can be left out: not read by any operation that
    also produces something kept (a buffer computed from a weight must see real values)."""
    groups = set(groups)
    changed = True
    while changed:
        changed = False
        for op_refs in refs:
            touched = {record.group_of[r.index] for r in _touched(op_refs)}
            if touched & groups and touched - groups:
                groups -= touched
                changed = True
    return groups


def _retie(model: nn.Module, record: DeferredInit) -> None:
    """Make every name recorded as the same tensor point at one object again."""
    first: dict[int, torch.Tensor | None] = {}
    for _, ref, module, leaf in _owners(model, record):
        # cast: a parameter's name is tied back to a Parameter; the dict types are invariant.
        holder = cast("dict[str, torch.Tensor | None]",
                      module._parameters if leaf in module._parameters else module._buffers)
        if ref in first:
            holder[leaf] = first[ref]
        else:
            first[ref] = holder[leaf]


def sharded_device(model: nn.Module) -> torch.device | None:
    """The device of the first DTensor parameter's mesh; ``None`` without one."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
                else torch.device(mesh.device_type)
    return None


def _fill(target: torch.Tensor, full: torch.Tensor, parts: list[FlatPart] | None = None) -> None:
    """Copy ``full`` (the whole tensor, on CPU) into ``target``, or just this rank's
    share of it: a sharded DTensor's local slice, or the flat ``parts`` of an engine that
    shards flattened parameters."""
    with torch.no_grad():
        if parts is not None:
            flat = full.reshape(-1)
            for part in parts:
                if part.stop > part.start:
                    part.destination[:part.stop - part.start].copy_(flat[part.start:part.stop])
        elif (block := dtensor_block(target)) is not None:
            # Every rank holds the same full value and copies out its own block (rows of
            # an FSDP2 shard; rows and columns of a tensor-parallel shard FSDP2 shards
            # again): no communication.
            local(target).copy_(full[block.slices()])
        else:
            target.copy_(full)


# In-place operations that replace every element of their target (when the target
# covers its whole storage): the values before them are never read.
_OVERWRITES = {
    torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default,
    torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default,
    torch.ops.aten.copy_.default, torch.ops.aten.bernoulli_.float,
    torch.ops.aten.exponential_.default, torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"), torch.ops.aten.random_.to,
}


@dataclasses.dataclass
class ReplayStats:
    """Counted while replaying: the most bytes alive at once in full (unsharded) tensors."""

    ops: int = 0
    peak_bytes: int = 0


class _Schedule:
    """For each storage group: when it is last used, and which writes are dead (the next
    thing to touch the group overwrites it again, as when ``_init_weights`` re-initializes
    what ``reset_parameters`` already filled). A dead write still runs, for its random
    numbers, but into a scratch tensor that is dropped at once."""

    def __init__(self, record: DeferredInit, refs: list[_OpRefs]) -> None:
        self.last_use: dict[int, int] = {}
        self.dead: set[int] = set()
        self.target: dict[int, int] = {}  # op index -> ref index it overwrites
        events: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for i, (op, (inputs, outputs)) in enumerate(zip(record.ops, refs, strict=True)):
            overwritten = self._overwritten(op, record)
            touched: dict[int, str] = {}
            for leaf in inputs:
                group = record.group_of[leaf.index]
                kind = "w" if overwritten is not None and leaf == overwritten else "r"
                touched[group] = "r" if touched.get(group) == "r" else kind
            for leaf in outputs:
                if isinstance(leaf, Ref):
                    touched.setdefault(record.group_of[leaf.index], "w" if op.func in UNINITIALIZED else "r")
            for group, kind in touched.items():
                events[group].append((i, kind))
                self.last_use[group] = i
            if overwritten is not None:
                self.target[i] = overwritten.index
        for group_events in events.values():
            for (i, kind), (_, next_kind) in zip(group_events, group_events[1:], strict=False):
                if kind == "w" and next_kind == "w" and i in self.target:
                    self.dead.add(i)

    @staticmethod
    def _overwritten(op: Any, record: DeferredInit) -> Ref | None:
        if op.func not in _OVERWRITES or not op.args or not isinstance(op.args[0], Ref):
            return None
        return op.args[0] if record.layout[op.args[0].index].whole else None


def _replay(record: DeferredInit, refs: list[_OpRefs], targets: dict[str, torch.Tensor], show: bool | None,
            skipped: set[int] | None = None,
            flat_parts: Mapping[int, list[FlatPart]] | None = None) -> ReplayStats:
    schedule = _Schedule(record, refs)
    named = {**record.tensors, **record.attributes}
    names_by_group: dict[int, list[str]] = defaultdict(list)
    for name, ref in named.items():
        names_by_group[record.group_of[ref]].append(name)
    release_at: dict[int, list[int]] = defaultdict(list)
    for group, i in schedule.last_use.items():
        release_at[i].append(group)

    env: dict[int, torch.Tensor] = dict(record.constants)
    # Tensors not allocated yet: made by an `empty` (contents undefined) or an alias of one.
    # They are created when something first needs their contents.
    lazy: dict[int, Any] = {}
    refs_of: dict[int, list[int]] = defaultdict(list)
    for index in env:
        refs_of[record.group_of[index]].append(index)
    stats = ReplayStats()
    scratches: list[tuple[StorageWeakRef, int]] = []  # dead writes' storages, for the peak

    def resolve(x: Any) -> Any:
        if not isinstance(x, Ref):
            return x
        if x.index not in env:
            op, position = lazy.pop(x.index)
            outputs = list(leaves(op.func(*map_leaves(resolve, op.args), **map_leaves(resolve, op.kwargs))))
            env[x.index] = outputs[position]
        return env[x.index]

    def is_lazy(x: Any) -> bool:
        return isinstance(x, Ref) and x.index in lazy

    def remember(op: Any, outputs: list[Any], result: Any) -> None:
        values = None if result is None else list(leaves(result))
        for position, ref in enumerate(outputs):
            if isinstance(ref, Ref) and ref.index not in env and ref.index not in lazy:
                refs_of[record.group_of[ref.index]].append(ref.index)
                if values is None:
                    lazy[ref.index] = (op, position)
                else:
                    env[ref.index] = values[position]

    saved_rng = torch.get_rng_state()
    torch.set_rng_state(record.rng_state)
    total = len(record.ops)
    try:
        with torch.no_grad(), Progress("materializing", total, show=show) as progress:
            for i, (op, op_refs) in enumerate(zip(record.ops, refs, strict=True)):
                if op.rng_state is not None:  # the constructor seeded here (torch.manual_seed)
                    torch.set_rng_state(op.rng_state)
                touched = _touched(op_refs)
                if skipped and touched and all(record.group_of[r.index] in skipped for r in touched):
                    continue  # initializes only what a checkpoint will overwrite
                tensor_args, outputs = op_refs
                aliasing = all(r.alias_info is not None and not r.alias_info.is_write
                               for r in op.func._schema.returns)
                if op.func in UNINITIALIZED or (aliasing and tensor_args and all(map(is_lazy, tensor_args))):
                    remember(op, outputs, None)  # allocate later, when contents are needed
                elif i in schedule.dead:
                    layout = record.layout[schedule.target[i]]
                    scratch = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype)
                    op.func(scratch, *map_leaves(resolve, op.args[1:]), **map_leaves(resolve, op.kwargs))
                    storage = scratch.untyped_storage()
                    scratches.append((StorageWeakRef(storage), storage.nbytes()))
                    stats.peak_bytes = max(stats.peak_bytes, _alive_bytes(env) + storage.nbytes())
                    del scratch, storage  # before the next op allocates: one full tensor at a time
                else:
                    remember(op, outputs, op.func(*map_leaves(resolve, op.args), **map_leaves(resolve, op.kwargs)))
                # A scratch still referenced here would overlap the next allocation: count it.
                scratches = [(ref, n) for ref, n in scratches if not ref.expired()]
                stats.peak_bytes = max(stats.peak_bytes, _alive_bytes(env) + sum(n for _, n in scratches))
                for group in release_at.get(i, ()):
                    for name in names_by_group.get(group, ()):
                        target = targets.get(name)
                        if target is None:  # kept (mapped): only computed, for what reads it
                            continue
                        _fill(target, resolve(Ref(named[name])),
                              (flat_parts or {}).get(id(target)))
                    for index in refs_of.pop(group, ()):
                        env.pop(index, None)
                        lazy.pop(index, None)
                progress.advance()
        stats.ops = total
    finally:
        torch.set_rng_state(saved_rng)
    return stats


def _alive_bytes(env: dict[int, torch.Tensor]) -> int:
    storages = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes() for t in env.values()}
    return sum(storages.values())
