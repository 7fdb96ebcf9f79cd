"""FSDP2 (``torch.distributed.fsdp.fully_shard``) driven by a Plan.

The order of steps, as torchtitan's parallelize code does it:
1. activation checkpointing inside each unit (it must sit inside the shard unit, so the
   recomputation runs while the unit's parameters are gathered for backward), and the
   activation offload hooks (`annot.runtime.activation_offload`), which leave parameters alone;
2. ``fully_shard`` once per shard unit, children before parents (each call groups the
   parameters not yet claimed by an earlier call, so the order decides the groups);
   a tied group's modules go into one call so the shared parameter has one owner;
3. ``fully_shard`` on the root last: it takes what no unit holds (embeddings, final
   norm, head) and becomes the module whose forward starts each iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.runtime.activation_offload import apply_activation_offload
from annot.policies import Action, Plan, Unit

__all__ = ["apply_fsdp2", "mixed_precision_policy"]


def mixed_precision_policy(
    mixed_precision: MixedPrecisionPolicy | torch.dtype | None,
) -> MixedPrecisionPolicy:
    """``None``: no casting (fp32 stays fp32). A dtype: compute and all-gather in it,
    reduce gradients in fp32 (low-precision reductions lose updates). A
    `MixedPrecisionPolicy` is used as given."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    return MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)


def _offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    # Pinned host memory speeds up host-to-GPU copies; there is no GPU to copy to on CPU.
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()


def _unit_offloads(unit: Unit, offload: bool | None) -> bool:
    return unit.has(Action.OFFLOAD) if offload is None else offload


def apply_fsdp2(
    model: nn.Module,
    plan: Plan,
    *,
    checkpoint_paths: Sequence[str],
    offload: bool | None,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | None,
    reshard_after_forward: bool,
    mesh: DeviceMesh | None,
    device: torch.device,
    offload_activation_paths: Sequence[str] = (),
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 following ``plan``; returns ``model``.

    ``offload`` is parameter offload (FSDP2's ``CPUOffloadPolicy``: parameters, gradients
    and optimizer state on CPU): ``None`` for the units the Plan marks, ``True`` every
    unit and the root, ``False`` none. ``offload_activation_paths`` is activation
    offload: the modules whose saved activations wait on the host, whatever ``offload``.
    ``reshard_after_forward``: ``True`` frees gathered parameters after each unit's
    forward (ZeRO-3-like), ``False`` keeps them until backward (ZeRO-2-like). The root is
    left to FSDP2, which does not reshard it: backward needs it at once.
    """
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = mixed_precision_policy(mixed_precision)

    apply_checkpointing(model, checkpoint_paths)
    apply_activation_offload(model, offload_activation_paths)

    for unit in plan.units:
        if not unit.has(Action.SHARD):
            continue
        modules = [model.get_submodule(path) for path in unit.modules]
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=_offload_policy(_unit_offloads(unit, offload), device),
        )

    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=_offload_policy(bool(offload), device),
    )
    return model

