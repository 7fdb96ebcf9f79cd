"""Checks and defaults shared by the engines: process group, device, mesh, misuse.

Every check here guards a mistake the engines themselves punish late (a hang, a crash
deep in a collective, an optimizer that silently updates nothing), so `auto_wrap` runs
them before touching the model.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from annot.errors import MetaDeviceError, OptimizerOrderError, ProcessGroupNotInitializedError

__all__ = [
    "forbid_stale_optimizers",
    "check_not_meta",
    "default_device",
    "require_process_group",
]


def require_process_group(engine: str) -> None:
    """Raise `ProcessGroupNotInitializedError` unless the default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupNotInitializedError(
            f"engine {engine!r} needs torch.distributed, but no process group is initialized. "
            "Launch with torchrun (e.g. `torchrun --nproc_per_node 2 train.py`) and call "
            "torch.distributed.init_process_group() (backend 'nccl' on GPUs, 'gloo' on CPU) "
            "before annot.auto_wrap()."
        )


def default_device(device: torch.device | str | None) -> torch.device:
    """``device`` if given; else this rank's GPU (``LOCAL_RANK``, made current) or the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)  # FSDP2 and NCCL use the current device
        return local
    return torch.device("cpu")


def check_not_meta(model: nn.Module) -> None:
    """Raise `MetaDeviceError` listing the modules whose tensors have no storage yet."""
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise MetaDeviceError(
            f"{type(model).__name__} has tensors on the meta device ({shown}) and no record of "
            "how to initialize them: build it under `with annot.meta_init():` (then auto_wrap "
            "materializes it shard by shard), or on a real device, before annot.auto_wrap()."
        )


def forbid_stale_optimizers(before: list[nn.Parameter], wrapped: nn.Module, engine: str) -> None:
    """Make an optimizer built before wrapping fail at its first ``step``.

    An engine that replaces parameter objects (FSDP2: DTensor parameters) leaves an
    optimizer built before it stepping tensors the model no longer uses: training would
    silently do nothing (docs/design.md, pitfall 6). ``before`` are the parameters as they
    were; those ``wrapped`` no longer holds are remembered (weakly), and a global
    optimizer step hook raises `OptimizerOrderError` when an optimizer holding one steps.
    Costs one pass over the parameters here and a dictionary lookup per ``step``
    (each optimizer is checked again only when its parameter count changes).
    """
    kept = {id(p) for p in wrapped.parameters()}
    for param in before:
        if id(param) not in kept:
            _REPLACED[id(param)] = (weakref.ref(param, _forget(id(param))), engine, type(wrapped).__name__)
    global _HOOK
    if _HOOK is None and _REPLACED:
        _HOOK = register_optimizer_step_pre_hook(_refuse_stale)


# id(parameter) -> (weak reference, engine, model class) for parameters an engine replaced.
_REPLACED: dict[int, tuple[weakref.ref[nn.Parameter], str, str]] = {}
# optimizer -> parameter count when it was last checked.
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HOOK: Any = None


def _forget(key: int) -> Callable[[Any], None]:
    def drop(_: Any) -> None:
        _REPLACED.pop(key, None)
    return drop


def _refuse_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _REPLACED.get(id(param))
            if entry is not None and entry[0]() is param:
                _, engine, model = entry
                raise OptimizerOrderError(
                    f"this {type(optimizer).__name__} was built before annot.auto_wrap("
                    f"engine={engine!r}) and holds parameters of {model} that {engine} replaced: "
                    "it would update tensors the model no longer uses. Build the optimizer "
                    "after wrapping: model = annot.auto_wrap(model, ...); "
                    "opt = torch.optim.AdamW(model.parameters()), or pass "
                    "optimizer=lambda params: torch.optim.AdamW(params) to auto_wrap.")
    _CHECKED[optimizer] = count
