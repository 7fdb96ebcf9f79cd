"""Which device a rank computes on, and which process-group backend goes with it.

The one place annot picks a device (issue #30; docs/design.md, pitfall 36).
`choose_device` is what `annot.auto_wrap` and `annot.init_distributed` call;
`distributed_backend` is the backend for a device; `move_to_device` puts a batch where the
engine computes.

The rules, as torchrun, srun and Slurm users expect them:

- A rank's GPU is ``LOCAL_RANK % torch.cuda.device_count()`` (``SLURM_LOCALID`` when
  torchrun's ``LOCAL_RANK`` is absent). Under srun with one GPU per task every task sees
  one device, ``cuda:0``, whatever its local rank; ``LOCAL_RANK`` alone would name a
  device the task cannot see ("invalid device ordinal").
- A CUDA device, chosen or given, becomes the current device: FSDP2's mesh,
  `annot.materialize`, NCCL and DCP's object collectives all use the current one, not
  the one a caller passed.
- Without ``device=``, a process group whose backend is gloo keeps the rank on the CPU,
  so a two-rank gloo test on a one-GPU machine does not ask for ``cuda:1``. Ranks share
  ``cuda:0`` on gloo only when the caller asks for ``"cuda"``.
- A request for CUDA where there is none is one `DeviceNotAvailableError` naming what was
  found (device count, torch build, ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from annot.errors import DeviceNotAvailableError

__all__ = [
    "choose_device",
    "distributed_backend",
    "local_rank",
    "local_world_size",
    "move_to_device",
    "uses_cuda",
]

#: The backend for CUDA ranks: NCCL for CUDA tensors, gloo for the CPU tensors that
#: object collectives (DCP's plans, barriers on CPU tensors) and user code still send.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
CPU_BACKEND = "gloo"


def local_rank() -> int:
    """This process's rank on its node: torchrun's ``LOCAL_RANK``, else Slurm's
    ``SLURM_LOCALID`` (srun without torchrun), else 0 (one process)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return 0


def local_world_size() -> int | None:
    """How many ranks run on this node, as torchrun says (``LOCAL_WORLD_SIZE``); ``None``
    where no launcher said it. srun's tasks are left out on purpose: with one GPU per
    task each task sees a single device, and counting the node's tasks against it
    would call a normal srun job oversubscribed."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value is not None else None


def uses_cuda(backend: str) -> bool:
    """Whether a process-group backend string puts collectives on CUDA: ``"nccl"``, or a
    per-device string with a ``cuda:`` entry (``"cpu:gloo,cuda:nccl"``). torch's
    ``"undefined"`` (``init_process_group()`` with neither backend nor device) binds NCCL
    for CUDA when the build has it."""
    name = str(backend).lower()
    if name == "undefined":
        return torch.cuda.is_available()
    for entry in name.split(","):
        device_type, _, backend_name = entry.strip().rpartition(":")
        if device_type == "cuda" or backend_name == "nccl":
            return True
    return False


def choose_device(device: torch.device | str | None = None, *,
                  backend: str | None = None) -> torch.device:
    """The device this rank computes on; a CUDA device is also made the current one.

    ``device`` given: ``"cuda"`` (no index) is ``cuda:(LOCAL_RANK % device_count)``, an
    indexed CUDA device is checked against the devices this process sees, any other
    device (``"cpu"``) is returned as it is. ``device`` omitted: the CPU when the
    process group's backend (``backend``, else the default group's if one exists) keeps
    collectives off CUDA (gloo), else this rank's GPU when CUDA is available and, before
    any process group exists, torchrun's ranks on this node do not outnumber the GPUs;
    else the CPU.

    Raises `DeviceNotAvailableError` when CUDA is asked for (``device="cuda..."``, or an
    NCCL ``backend``) and this process sees no GPU, or an index it does not see.
    """
    if device is not None:
        requested = torch.device(device)
        if requested.type != "cuda":
            return requested
        return _current_cuda(requested.index, f"device={str(device)!r}")
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())
    if backend is not None:
        if uses_cuda(backend):
            return _current_cuda(None, f"process-group backend {backend!r}")
        return torch.device("cpu")
    if torch.cuda.is_available() and not _oversubscribed():
        return _current_cuda(None, "the default device")
    return torch.device("cpu")


def distributed_backend(device: torch.device) -> str:
    """The process-group backend for ranks computing on ``device``: ``"cpu:gloo,cuda:nccl"``
    on CUDA, ``"gloo"`` elsewhere, and ``"gloo"`` when torchrun starts more ranks on this
    node than it has GPUs (NCCL refuses two ranks on one GPU; gloo moves CUDA tensors)."""
    if device.type == "cuda" and not _oversubscribed():
        return CUDA_BACKEND
    return CPU_BACKEND


def move_to_device(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every tensor inside them (in tuples, lists, dicts,
    dataclasses) on ``device``, as torch's DDP and FSDP move their inputs; tensors already
    there are passed through untouched."""
    from torch.distributed.utils import _to_kwargs

    if not args and not kwargs:
        return args, dict(kwargs)
    moved_args, moved_kwargs = _to_kwargs(args, dict(kwargs), device, False)
    return moved_args[0], moved_kwargs[0]


def _oversubscribed() -> bool:
    ranks = local_world_size()
    return ranks is not None and ranks > torch.cuda.device_count()


def _current_cuda(index: int | None, asked: str) -> torch.device:
    """``cuda:index`` (``None``: this rank's by local rank), made the current device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceNotAvailableError(f"{asked} needs a CUDA GPU, but {_what_was_found()}. "
                                      "Pass device='cpu' (and backend 'gloo'), or run where "
                                      "a GPU is visible.")
    if index is None:
        index = local_rank() % count
        if _oversubscribed():
            warnings.warn(
                f"{local_world_size()} ranks on this node share {count} GPU(s): rank "
                f"{local_rank()} uses cuda:{index}", stacklevel=3)
    elif index >= count:
        raise DeviceNotAvailableError(
            f"{asked}: this process sees {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
            f"{_what_was_found()}. Pass device='cuda' to take LOCAL_RANK % {count}.")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _what_was_found() -> str:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    return (f"torch.cuda.device_count() is {count}, torch {torch.__version__} is {build}, "
            f"CUDA_VISIBLE_DEVICES is {'unset' if visible is None else repr(visible)}")
