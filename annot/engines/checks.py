"""Checks and defaults shared by the engines: process group, device, mesh, misuse.

Every check here guards a mistake the engines themselves punish late (a hang, a crash
deep in a collective, an optimizer that silently updates nothing), so `auto_wrap` runs
them before touching the model.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch import nn

from annot.errors import MetaDeviceError, OptimizerOrderError, ProcessGroupNotInitializedError

__all__ = [
    "check_no_optimizer",
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


def check_no_optimizer(model: nn.Module, engine: str) -> None:
    """Raise `OptimizerOrderError` if a live optimizer already holds one of ``model``'s
    parameters.

    Sharding engines replace the parameters (FSDP2 with DTensors, FSDP1 and ZeRO with
    flat buffers), so an optimizer built before wrapping keeps stepping the old tensors:
    training silently does nothing (docs/design.md, pitfall 6). The scan walks the objects the
    garbage collector tracks once, which costs milliseconds next to wrapping a model.
    """
    own = {id(p) for p in model.parameters()}
    if not own:
        return
    gc.collect()  # an optimizer the user dropped but a reference cycle still holds is not one
    for obj in gc.get_objects():
        # issubclass(type(...)): isinstance() would read __class__ on every object, and
        # some module-like objects warn when touched that way.
        if issubclass(type(obj), torch.optim.Optimizer) and any(
            id(p) in own for group in obj.param_groups for p in group["params"]
        ):
            raise OptimizerOrderError(
                f"a {type(obj).__name__} built before annot.auto_wrap(engine={engine!r}) holds "
                f"parameters of {type(model).__name__}; {engine} replaces them, so that "
                "optimizer would update tensors the model no longer uses. Build the optimizer "
                "after wrapping: model = annot.auto_wrap(model, ...); "
                "opt = torch.optim.AdamW(model.parameters())."
            )
