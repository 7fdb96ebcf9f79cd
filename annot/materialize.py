"""`materialize`: give a `meta_init` model real values, unit by unit, shard by shard.

The tape recorded at construction is replayed on the CPU from the recorded random
state, in order (so the random stream, and so every value, is exactly eager
construction's). A tensor's storage is allocated when an operation first produces it
and released right after its last use on the tape; at that moment each parameter or
buffer living in it is copied into the model: whole for a plain module, only this
rank's slice for a sharded one (an FSDP2 DTensor). Peak memory is therefore the model's
shard plus about one parameter, whatever the number of ranks, and the result does not
depend on the number of ranks.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from annot.deferred import DeferredInit, DeferredInitError, Ref, deferred_init_of

__all__ = ["materialize"]


def materialize(model: nn.Module, *, device: torch.device | str | None = None,
                progress: bool | None = None) -> nn.Module:
    """Allocate ``model``'s tensors on ``device`` (default: CPU, or the device its sharded
    parameters were placed on) and fill them from the `meta_init` record. Returns the model.

    Raises `DeferredInitError` when the model was not built under `annot.meta_init`,
    when a module owns parameters nothing initializes, or when a tensor is left on the
    meta device. The caller's random-number state is left as it was.
    """
    record = deferred_init_of(model)
    if record is None:
        raise DeferredInitError(
            f"{type(model).__name__} was not built under annot.meta_init(), so there is no "
            "record of how to initialize it: build it with `with annot.meta_init(): ...` "
            "or annot.build(cls, ...)."
        )
    missing = record.uninitialized()
    if missing:
        modules = sorted({record.module_of[n] or "(root)" for n in missing})
        raise DeferredInitError(
            f"no init path for {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}: "
            f"module(s) {', '.join(modules)} create parameters that nothing initializes. "
            "Define reset_parameters() on the module, initialize them in __init__, or call "
            "annot.register_init(ModuleClass, fn)."
        )
    targets = _targets(model, record)
    if any(t.is_meta for t in targets.values()):
        # to_empty allocates only local shards for FSDP2 modules, but gives each module's
        # visit of a tied parameter its own new Parameter: tie them again right after.
        model.to_empty(device=device or _sharded_device(model) or "cpu")
        _retie(model, record)
        targets = _targets(model, record)
    show = progress if progress is not None else _is_progress_rank()
    _replay(record, targets, show)
    leftover = [n for n, t in _targets(model, record).items() if _local(t).is_meta]
    if leftover:
        raise DeferredInitError(f"still on the meta device after materializing: {', '.join(leftover)}")
    return model


def _targets(model: nn.Module, record: DeferredInit) -> dict[str, torch.Tensor]:
    out = {}
    for name in record.tensors:
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        tensor = module._parameters.get(leaf)
        out[name] = tensor if tensor is not None else module._buffers[leaf]
    return out


def _retie(model: nn.Module, record: DeferredInit) -> None:
    """Make every name recorded as the same tensor point at one object again."""
    first: dict[int, torch.Tensor] = {}
    for name, ref in record.tensors.items():
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        holder = module._parameters if leaf in module._parameters else module._buffers
        if ref in first:
            holder[leaf] = first[ref]
        else:
            first[ref] = holder[leaf]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
                else torch.device(mesh.device_type)
    return None


def _is_progress_rank() -> bool:
    if not sys.stderr.isatty():
        return False
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, on CPU) into ``target``, or just this rank's
    slice of it when ``target`` is a sharded DTensor."""
    with torch.no_grad():
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: every rank holds the same full value and slices it
            # locally, no communication.
            piece = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(piece.to_local())
        else:
            target.copy_(full)


def _replay(record: DeferredInit, targets: dict[str, torch.Tensor], show: bool) -> None:
    last_use: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        for leaf in tree_flatten((op.args, op.kwargs, op.out))[0]:
            if isinstance(leaf, Ref):
                last_use[record.group_of[leaf.index]] = i
    names_by_group: dict[int, list[str]] = defaultdict(list)
    for name, ref in record.tensors.items():
        names_by_group[record.group_of[ref]].append(name)
    release_at: dict[int, list[int]] = defaultdict(list)
    for group, i in last_use.items():
        release_at[i].append(group)
    refs_by_group: dict[int, list[int]] = defaultdict(list)

    env: dict[int, torch.Tensor] = dict(record.constants)
    for index in env:
        refs_by_group[record.group_of[index]].append(index)

    def decode(x: Any) -> Any:
        return env[x.index] if isinstance(x, Ref) else x

    saved_rng = torch.get_rng_state()
    torch.set_rng_state(record.rng_state)
    total = len(record.ops)
    try:
        with torch.no_grad():
            for i, op in enumerate(record.ops):
                result = op.func(*tree_map(decode, op.args), **tree_map(decode, op.kwargs))
                for ref, value in zip(tree_flatten(op.out)[0], tree_flatten(result)[0], strict=False):
                    if isinstance(ref, Ref) and ref.index not in env:
                        env[ref.index] = value
                        refs_by_group[record.group_of[ref.index]].append(ref.index)
                for group in release_at.get(i, ()):
                    for name in names_by_group.get(group, ()):
                        _fill(targets[name], env[record.tensors[name]])
                    for index in refs_by_group.pop(group, ()):
                        env.pop(index, None)
                if show and (i % 200 == 0 or i == total - 1):
                    print(f"\rmaterializing: {100 * (i + 1) // total:3d}% ({i + 1}/{total} ops)",
                          end="" if i < total - 1 else "\n", file=sys.stderr, flush=True)
    finally:
        torch.set_rng_state(saved_rng)
