"""FSDP1 (``FullyShardedDataParallel``) driven by a Plan, and the Plan as FSDP1 policies.

`fsdp1_policies` turns a Plan into the two policies torch's FSDP1 and Lightning's
``FSDPStrategy(auto_wrap_policy=..., activation_checkpointing_policy=...)`` take. They
select the Plan's modules by path and class on whatever tree the tool hands them (a copy,
the model built in ``configure_model``, a tree FSDP1 already wrapped: `PlanPolicy`), so a
Plan made with any rule (by name, every-Nth, marks) carries over exactly, and one that
matches nothing there is an error.

`FSDP1` follows the engine contract (`annot.engines.base`): the Plan's modules are
checkpointed first (annot's run-time checkpointing swaps ``forward`` on the instance and
adds no wrapper module, so the wrap policy still sees the original modules; torch's
``checkpoint_wrapper`` would have to come after wrapping), then `apply_fsdp1` makes one
``FullyShardedDataParallel`` call whose wrap policy wraps every shard unit bottom-up and
the root last; `shard_layout` says where each parameter's shard is, for filling it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from annot.engines.base import (
    INIT_SCALE,
    Engine,
    EngineState,
    OptimizerFactory,
    Trainable,
    WrapRequest,
    is_fp16,
    refuse_nvme_marks,
    refuse_plan_activation_choices,
    resolve_dtype,
    resolve_torch_offload,
)
from annot.engines.checks import refuse_computing_outside_forward
from annot.engines.dtypes import refuse_fsdp1_dtypes
from annot.engines.mesh import MeshLike, data_parallel_mesh, refuse_context_parallel, resolve_mesh
from annot.engines.tool_policy import PlanPolicy
from annot.engines.training_state import FlatState
from annot.errors import EngineNotAvailableError
from annot.meta.deferred import DeferredInitError
from annot.meta.layout import FlatPart, ShardLayout
from annot.meta.unit_allocation import UnitAllocator
from annot.planning import resolve_plan
from annot.policies import Action, Plan, Policy, Rule
from annot.runtime.units import unit_paths

__all__ = [
    "FSDP1", "FSDP1Options", "FSDP1Trainable", "FullyShardedDataParallel", "apply_fsdp1",
    "fsdp1_policies", "shard_layout",
]

# FSDP1 inserts a module under this name above each module it wraps; no key contains it.
WRAPPED_MODULE = "_fsdp_wrapped_module"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP1Options:
    """Options of ``engine="fsdp1"`` (torch's ``FullyShardedDataParallel``, always with
    ``use_orig_params=True``).

    Args:
        reshard_after_forward: ``FULL_SHARD`` (the default) or ``SHARD_GRAD_OP``.
        offload: ``True``/``"cpu"`` offloads every parameter (FSDP1 offloads all or
            none; it needs a GPU, since it pins host memory), ``False`` none, ``None``
            as the Plan marks, if it marks all units or none.
        mixed_precision: ``None``, ``"bf16"``/``"fp16"``/a dtype (reductions in fp32) or
            a ``MixedPrecision``. fp16 compute (``param_dtype`` fp16) gives the
            `Trainable` a ``ShardedGradScaler`` (loss scaling, skipped steps on inf/NaN).
        mesh: a device mesh over every rank, or `annot.ParallelDims` to build it from;
            default the Plan's parallel dims, else the default process group. A 2-D mesh
            (replicate, shard) is ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2`` with
            ``reshard_after_forward=False``): each rank's flat shard is over its shard
            group, gradients are all-reduced across replicas. Read as for FSDP2
            (`annot.engines.mesh`); FSDP1 has no tensor parallelism here.
    """

    reshard_after_forward: bool = True
    offload: bool | str | None = None
    mixed_precision: MixedPrecision | torch.dtype | str | None = None
    mesh: MeshLike | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", resolve_torch_offload(self.offload, "fsdp1"))
        object.__setattr__(self, "mixed_precision", resolve_dtype(self.mixed_precision))


class FSDP1(Engine[FSDP1Options]):
    """torch FSDP1: one ``FullyShardedDataParallel`` call whose wrap policy is the Plan."""

    name = "fsdp1"
    maps_checkpoint = False
    Options = FSDP1Options

    def __init__(self) -> None:
        #: The mesh `check` resolved (``None``: the default process group).
        self.mesh: DeviceMesh | None = None

    hints = {
        "offload_activations": "activation offload is wired for engine='fsdp2' or 'ddp'",
        "stage": "FSDP1 says it with reshard_after_forward=True (FULL_SHARD) or False "
                 "(SHARD_GRAD_OP)",
    }

    def check(self, model: nn.Module, request: WrapRequest, options: FSDP1Options) -> None:
        plan = request.plan
        _refuse_groups(plan)
        refuse_plan_activation_choices(plan, self.name, selective=True, offload=False)
        _refuse_offload_on_cpu(bool(options.offload), request.device)
        refuse_fsdp1_dtypes(model, plan)
        refuse_computing_outside_forward(model, self.name)
        if options.offload is None:  # the Plan decides what is offloaded
            refuse_nvme_marks(plan, self.name)
            if any(u.has(Action.OFFLOAD) for u in plan.units):
                raise EngineNotAvailableError(
                    "the Plan offloads some units, but FSDP1 offloads all parameters or none: "
                    "pass offload=True or offload=False, or use engine='fsdp2'")
        refuse_context_parallel(options.mesh if options.mesh is not None else plan.parallel,
                                self.name)
        mesh = resolve_mesh(options.mesh, plan.parallel, request.device.type, self.name)
        if mesh is not None:
            self.mesh = _whole_world_mesh(data_parallel_mesh(mesh))

    def wrap(self, model: nn.Module, request: WrapRequest, options: FSDP1Options) -> nn.Module:
        return apply_fsdp1(
            # __post_init__ resolved offload to None/True/False and a name ("bf16") to a dtype
            model, request.plan, offload=cast("bool | None", options.offload),
            mixed_precision=cast("MixedPrecision | torch.dtype | None", options.mixed_precision),
            reshard_after_forward=options.reshard_after_forward, device=request.device,
            mesh=self.mesh)

    def layout(self, wrapped: nn.Module) -> ShardLayout:
        return shard_layout(wrapped)

    def loss_scaler(self, options: FSDP1Options, device: torch.device) -> ShardedGradScaler | None:
        # Each rank holds only its flat shard's gradients: an inf on one rank must skip
        # the step on all (the sharded scaler all-reduces what it found).
        return ShardedGradScaler(device.type, init_scale=INIT_SCALE) if is_fp16(options.mixed_precision) else None

    def trainable(self, wrapped: nn.Module, model: nn.Module, optimizer: OptimizerFactory,
                  options: FSDP1Options, *, device: torch.device | None = None) -> Trainable:
        base = super().trainable(wrapped, model, optimizer, options, device=device)
        return FSDP1Trainable(base.module, base.model, base.optimizer, base.engine,
                              device=base.device, scaler=base.scaler)

    def state(self, trainable: Trainable) -> EngineState:
        """This rank's flat ranges as chunks of the real tensors (docs/design.md, pitfall 24)."""
        return FlatState(trainable, self.layout(trainable.module))


class FSDP1Trainable(Trainable):
    """FSDP1's `Trainable`: gradients are flat shards, so clipping goes through the root
    ``FullyShardedDataParallel.clip_grad_norm_``, which reduces the norm over the ranks."""

    def _clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        return cast(FullyShardedDataParallel, self.module).clip_grad_norm_(max_norm, norm_type)


def _refuse_offload_on_cpu(offload: bool, device: torch.device) -> None:
    if offload and device.type == "cpu":
        # Measured with torch 2.13: FSDP1 pins the offloaded shards unconditionally, which
        # crashes without an accelerator ("Cannot access accelerator device").
        raise EngineNotAvailableError(
            "FSDP1 parameter offload pins host memory and needs a GPU: on CPU use "
            "engine='fsdp2' (its CPUOffloadPolicy works there) or offload=False")


def _whole_world_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` (1-D or (replicate, shard)) if it spans every rank. FSDP1 reduces over its
    mesh alone, so a smaller one would leave ranks training unsynchronised copies
    (docs/design.md, pitfall 21), and annot gives FSDP1 no tensor parallelism to cover
    the rest."""
    world = dist.get_world_size()
    if mesh.size() != world:
        dims = "x".join(str(n) for n in mesh.mesh.shape)
        raise EngineNotAvailableError(
            f"FSDP1 shards and replicates over mesh={dims} ({mesh.size()} ranks), not over the "
            f"{world} ranks of the world: the others would train unsynchronised copies. Give a "
            f"mesh or ParallelDims over all {world} ranks (tp=1); tensor parallelism is "
            "engine='fsdp2'")
    return mesh


def _refuse_groups(plan: Plan) -> None:
    grouped = [u.path for u in plan.units if u.has(Action.SHARD) and u.group]
    if grouped:
        raise EngineNotAvailableError(
            f"units {', '.join(grouped)} group modules at different paths (tied weights); "
            "FSDP1 wraps one module per unit: use engine='fsdp2', which shards a group together")


def shard_layout(model: nn.Module) -> ShardLayout:
    """Where FSDP1 keeps ``model``'s parameters on this rank. With ``use_orig_params=True``
    each original parameter is a 1-D view of the part of it that lies in this rank's
    flat shard (empty when none of it is here)."""
    parts: dict[int, list[FlatPart]] = {}
    owners: dict[int, FullyShardedDataParallel] = {}
    for fsdp_module in FullyShardedDataParallel.fsdp_modules(model):
        handle = fsdp_module._handle
        if handle is None:
            continue
        if not handle._use_orig_params:
            raise DeferredInitError(
                "annot fills FSDP1 models built with use_orig_params=True only (auto_wrap sets it)")
        flat = handle.flat_param
        if flat._params is None:  # FSDP1 keeps them with use_orig_params=True (checked above)
            raise DeferredInitError("an FSDP1 flat parameter without its original parameters")
        # Private to FSDP1 (torch >= 2.1): where each original parameter lies in the shard.
        for param, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes, strict=True):
            start, end = info.intra_param_start_idx, info.intra_param_end_idx  # None: not in_shard
            span = (start, end + 1) if start is not None and end is not None else (0, 0)
            # Sharded, the parameter is already 1-D; at world size 1 FSDP1 keeps NO_SHARD
            # and each parameter has its own shape: either way, 1-D over the same memory
            # (docs/design.md, pitfall 49).
            parts[id(param)] = [FlatPart(param.detach().view(-1), *span, tuple(shape))]
            owners[id(param)] = fsdp_module
    if not parts and not isinstance(model, FullyShardedDataParallel):
        return ShardLayout()
    if not isinstance(model, FullyShardedDataParallel):
        # The root wrapper's shard (what no unit holds) cannot be located from inside.
        raise EngineNotAvailableError(
            f"{type(model).__name__} holds FSDP1 units but is not the FullyShardedDataParallel "
            "root: pass what auto_wrap returned (or its Trainable)")

    # The last unit gathered: its flat parameter's version then, and copies of its
    # parameters not asked for yet. A save asks for a unit's parameters one after another,
    # so one all-gather serves the whole unit (gathering it again per parameter made an
    # FSDP1 save about 8x slower than ZeRO-3's, measured); at most one unit is kept.
    cache: dict[int, torch.Tensor] = {}
    gathered: list[tuple[FullyShardedDataParallel, int]] = []

    def gather(param: torch.Tensor) -> torch.Tensor:
        owner = owners[id(param)]
        flat = owner._handle.flat_param  # type: ignore[union-attr]  # owners have a handle
        if id(param) not in cache or gathered != [(owner, flat._version)]:  # stale: changed since
            cache.clear()
            gathered[:] = [(owner, flat._version)]
            # The unit's full parameters exist only inside this block; each original
            # parameter is then a view of its whole value.
            with FullyShardedDataParallel.summon_full_params(owner, recurse=False, writeback=False):
                for p in flat._params or ():
                    cache[id(p)] = p.detach().clone()
        return cache.pop(id(param))

    return ShardLayout(parts, frozenset({WRAPPED_MODULE}), "fsdp1", gather)


def fsdp1_policies(
    model: nn.Module,
    policy: Policy | Rule | Plan | None = None,
    *,
    checkpoint: bool | None = None,
) -> tuple[PlanPolicy, PlanPolicy]:
    """``(auto_wrap_policy, activation_checkpointing_policy)`` for ``model``.

    ``policy`` is what `annot.auto_wrap` takes (a Policy, a rule, a Plan, or ``None`` for
    the model's marks). The first policy selects the shard units, the second the modules
    to checkpoint (the Plan's; ``checkpoint=True`` every unit, ``False`` none). Pass them
    to ``FullyShardedDataParallel(auto_wrap_policy=...)`` and torch's
    ``apply_activation_checkpointing(auto_wrap_policy=...)``, or to Lightning's
    ``FSDPStrategy``. A unit grouping several modules (tied weights) cannot be one FSDP1
    unit: that raises `EngineNotAvailableError`.

    Both select by the Plan's paths and classes on the module the tool passes them
    (``model`` may be a different instance: a deepcopy, the model a ``LightningModule``
    builds, or the user's model inside it), never by identity; one that selects nothing
    there raises `annot.PolicySelectionError` (docs/design.md, pitfall 15). When the
    checkpointing policy selects modules of a transformers model, that model's training
    forwards run with ``use_cache=False`` (pitfall 14).
    """
    plan = resolve_plan(model, policy)
    _refuse_groups(plan)
    shard = [u.path for u in plan.units if u.has(Action.SHARD)]
    checkpointed = unit_paths(plan, Action.CHECKPOINT, checkpoint)
    return (PlanPolicy(plan, shard, role="wrap"),
            PlanPolicy(plan, checkpointed, role="activation checkpointing",
                       no_cache_when_selected=True))


def apply_fsdp1(
    model: nn.Module,
    plan: Plan,
    *,
    offload: bool | None,
    mixed_precision: torch.dtype | MixedPrecision | None,
    reshard_after_forward: bool,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> FullyShardedDataParallel:
    """Wrap ``model`` in FSDP1 following ``plan`` (``use_orig_params=True``, so the
    optimizer sees the original parameters and frozen/trainable mixes work).

    Run-time checkpointing is installed before this (`Engine.prepare`): it swaps
    ``forward`` on the instance and adds no module, so the wrap policy still sees the
    Plan's modules. A model on the meta device is allocated unit by unit as FSDP1 wraps it (each unit's
    full parameters exist only until FSDP1 has sharded them) with undefined values:
    `annot.materialize` fills the shards afterwards, as `auto_wrap` does.

    FSDP1 offloads all parameters or none: ``offload=True`` offloads everything;
    a Plan that offloads only some units is refused unless ``offload`` is given.
    ``mesh``: ``None`` shards over the default process group; a 1-D mesh over it; a 2-D
    (replicate, shard) mesh is hybrid sharding (``HYBRID_SHARD``, or
    ``_HYBRID_SHARD_ZERO2`` without resharding after forward).
    """
    _refuse_offload_on_cpu(bool(offload), device)
    wrap_policy, _ = fsdp1_policies(model, plan)
    if isinstance(mixed_precision, torch.dtype):
        # Reductions in fp32: low-precision gradient sums lose small updates.
        mixed_precision = MixedPrecision(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    allocator = UnitAllocator(model, device)
    wrapped = FullyShardedDataParallel(
        model,
        # FSDP1 runs any _Policy; its annotation lists only torch's own policy classes.
        auto_wrap_policy=cast(Any, wrap_policy),
        sharding_strategy=_strategy(reshard_after_forward, hybrid=mesh is not None and mesh.ndim == 2),
        device_mesh=mesh,
        cpu_offload=CPUOffload(offload_params=bool(offload)),
        mixed_precision=mixed_precision,
        device_id=device,  # also on CPU: FSDP1 otherwise insists on an accelerator
        use_orig_params=True,
        param_init_fn=allocator,
    )
    allocator.record_on(wrapped)
    return wrapped


def _strategy(reshard_after_forward: bool, *, hybrid: bool) -> ShardingStrategy:
    if hybrid:  # torch's FSDP1 reads a 2-D mesh as (replicate, shard) by position
        return (ShardingStrategy.HYBRID_SHARD if reshard_after_forward
                else ShardingStrategy._HYBRID_SHARD_ZERO2)
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
