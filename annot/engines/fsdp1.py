"""FSDP1 (``FullyShardedDataParallel``) driven by a Plan, and the Plan as FSDP1 policies.

`fsdp1_policies` turns a Plan into the two policies torch's FSDP1 and Lightning's
``FSDPStrategy(auto_wrap_policy=..., activation_checkpointing_policy=...)`` take. They
select modules by identity (the Plan's paths resolved on this model instance), so a
Plan made with any rule (by name, every-Nth, marks) carries over exactly.

`apply_fsdp1` owns the order of steps: checkpoint the Plan's modules (annot's
run-time checkpointing swaps ``forward`` on the instance and adds no wrapper module, so
the wrap policy still sees the original modules; torch's ``checkpoint_wrapper`` would
have to come after wrapping), then one ``FullyShardedDataParallel`` call whose wrap
policy wraps every shard unit bottom-up and the root last.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import CustomPolicy

from annot.meta.unit_allocation import UnitAllocator
from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.errors import EngineNotAvailableError
from annot.policies import Action, Plan, Policy, Rule

__all__ = ["apply_fsdp1", "fsdp1_policies"]


def _selecting(modules: list[nn.Module]) -> CustomPolicy:
    chosen = {id(m) for m in modules}
    return CustomPolicy(lambda module: id(module) in chosen)


def fsdp1_policies(
    model: nn.Module,
    policy: Policy | Rule | Plan | None = None,
    *,
    checkpoint: bool | None = None,
) -> tuple[CustomPolicy, CustomPolicy]:
    """``(auto_wrap_policy, activation_checkpointing_policy)`` for ``model``.

    ``policy`` is what `annot.auto_wrap` takes (a Policy, a rule, a Plan, or ``None`` for
    the model's marks). The first policy selects the shard units, the second the modules
    to checkpoint (the Plan's; ``checkpoint=True`` every unit, ``False`` none). Pass them
    to ``FullyShardedDataParallel(auto_wrap_policy=...)`` and torch's
    ``apply_activation_checkpointing(auto_wrap_policy=...)``, or to Lightning's
    ``FSDPStrategy``. A unit grouping several modules (tied weights) cannot be one FSDP1
    unit: that raises `EngineNotAvailableError`.
    """
    from annot.runtime.activation_checkpoint import checkpointed_paths
    from annot.wrap import resolve_plan

    plan = resolve_plan(model, policy)

    grouped = [u.path for u in plan.units if u.has(Action.SHARD) and u.group]
    if grouped:
        raise EngineNotAvailableError(
            f"units {', '.join(grouped)} group modules at different paths (tied weights); "
            "FSDP1 wraps one module per unit: use engine='fsdp2', which shards a group together"
        )
    shard = [model.get_submodule(u.path) for u in plan.units if u.has(Action.SHARD)]
    checkpointed = [model.get_submodule(p) for p in checkpointed_paths(plan, checkpoint)]
    return _selecting(shard), _selecting(checkpointed)


def apply_fsdp1(
    model: nn.Module,
    plan: Plan,
    *,
    checkpoint_paths: Sequence[str],
    offload: bool | None,
    mixed_precision: torch.dtype | MixedPrecision | None,
    reshard_after_forward: bool,
    device: torch.device,
) -> FullyShardedDataParallel:
    """Wrap ``model`` in FSDP1 following ``plan`` (``use_orig_params=True``, so the
    optimizer sees the original parameters and frozen/trainable mixes work).

    A model on the meta device is allocated unit by unit as FSDP1 wraps it (each unit's
    full parameters exist only until FSDP1 has sharded them) with undefined values:
    `annot.materialize` fills the shards afterwards, as `auto_wrap` does.

    FSDP1 offloads all parameters or none: ``offload=True`` offloads everything;
    a Plan that offloads only some units is refused unless ``offload`` is given.
    """
    if offload is None and any(u.has(Action.OFFLOAD) for u in plan.units):
        raise EngineNotAvailableError(
            "the Plan offloads some units, but FSDP1 offloads all parameters or none: "
            "pass offload=True or offload=False, or use engine='fsdp2'"
        )
    if offload and device.type == "cpu":
        # Measured with torch 2.13: FSDP1 pins the offloaded shards unconditionally, which
        # crashes without an accelerator ("Cannot access accelerator device").
        raise EngineNotAvailableError(
            "FSDP1 parameter offload pins host memory and needs a GPU: on CPU use "
            "engine='fsdp2' (its CPUOffloadPolicy works there) or offload=False"
        )
    wrap_policy, _ = fsdp1_policies(model, plan)
    apply_checkpointing(model, checkpoint_paths)
    if isinstance(mixed_precision, torch.dtype):
        # Reductions in fp32: low-precision gradient sums lose small updates.
        mixed_precision = MixedPrecision(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    allocator = UnitAllocator(model, device)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=(
            ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        ),
        cpu_offload=CPUOffload(offload_params=bool(offload)),
        mixed_precision=mixed_precision,
        device_id=device,  # also on CPU: FSDP1 otherwise insists on an accelerator
        use_orig_params=True,
        param_init_fn=allocator,
    )
    allocator.record_on(wrapped)
    return wrapped
