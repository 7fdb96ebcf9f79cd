"""FSDP2 (``torch.distributed.fsdp.fully_shard``) driven by a Plan.

The order of steps, as torchtitan's parallelize code does it:
0. tensor parallelism on the mesh's ``"tp"`` dimension when it has one
   (`annot.engines.tensor_parallel`): the split modules' parameters become DTensors
   that ``fully_shard`` then shards further over the other dimensions;
1. activation checkpointing inside each unit (it must sit inside the shard unit, so the
   recomputation runs while the unit's parameters are gathered for backward), and the
   activation offload hooks (`annot.runtime.activation_offload`), which leave parameters alone;
2. ``fully_shard`` once per shard unit, children before parents (each call groups the
   parameters not yet claimed by an earlier call, so the order decides the groups);
   a tied group's modules go into one call so the shared parameter has one owner;
3. ``fully_shard`` on the root last: it takes what no unit holds (embeddings, final
   norm, head) and becomes the module whose forward starts each iteration.
Steps 0 and 1 are `FSDP2.prepare`, 2 and 3 `FSDP2.wrap` (`apply_fsdp2`), which
`auto_wrap` runs in that order; 2 and 3 shard over the data-parallel dimensions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from annot.engines.base import (
    INIT_SCALE,
    Engine,
    EngineState,
    OptimizerFactory,
    Trainable,
    WrapRequest,
    checkpoint_and_offload_activations,
    is_fp16,
    refuse_nvme_marks,
    resolve_dtype,
    resolve_torch_offload,
)
from annot.engines.checks import (
    refuse_bitsandbytes_parameters,
    refuse_computing_outside_forward,
    refuse_scalar_parameters,
)
from annot.engines.dtypes import refuse_fsdp2_dtypes
from annot.engines.fsdp2_experts import ExpertLayout, check_expert_parallel, shard_experts
from annot.engines.mesh import (
    MeshLike,
    context_parallel_mesh,
    requested_dims,
    resolve_mesh,
    split_mesh,
)
from annot.engines.tensor_parallel import (
    TP_DIM,
    TensorParallelPlan,
    TPSource,
    apply_tensor_parallel,
    check_tensor_parallel,
)
from annot.engines.training_state import TorchState
from annot.errors import EngineNotAvailableError
from annot.host_memory import pin_host_memory
from annot.policies import Action, Plan, Unit
from annot.policies.parallel import ParallelDims
from annot.runtime.context_parallel import ATTENTIONS, ContextParallel, refuse_unsplittable

__all__ = [
    "FSDP2", "FSDP2Options", "apply_fsdp2", "holds_fsdp2", "mixed_precision_policy",
    "pin_offloaded_state", "refuse_unsynchronised_mesh",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Options:
    """Options of ``engine="fsdp2"`` (torch's ``fully_shard``).

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward
            (ZeRO-3-like, the default) or keep them until backward (ZeRO-2-like).
        offload: parameter offload to CPU (``CPUOffloadPolicy``: parameters, gradients
            and optimizer state on the host): ``None`` the units the Plan marks,
            ``True``/``"cpu"`` every unit and the root, ``False`` none.
        offload_activations: keep what autograd saves in each unit's forward on the host
            until backward (`annot.runtime.activation_offload`).
        mixed_precision: ``None`` (as the parameters are), ``"bf16"``/``"fp16"``/a dtype
            (compute in it, reduce gradients in fp32), or a ``MixedPrecisionPolicy``.
            fp16 compute (``param_dtype`` fp16) gives the `Trainable` a
            ``ShardedGradScaler`` (loss scaling, skipped steps on inf/NaN).
        mesh: the device mesh to shard over, or `annot.ParallelDims` to build it from
            (``ParallelDims(replicate=2)``: HSDP, replicas across the outer ranks, each
            sharded over the inner ones); default the Plan's parallel dims, else a 1-D
            mesh over all ranks. A 2-D mesh is (replicate, shard): unnamed by position,
            named by its names (`annot.engines.mesh`). A dimension named ``"tp"`` (the
            last one) is tensor parallel: ``tp_plan`` is applied on it first, then FSDP2
            shards over the other dimensions (``"shard"``, or ``"replicate"`` and
            ``"shard"``: HSDP). A ``"cp"`` dimension (``ParallelDims(cp=2)``) is context
            parallel: parameters are sharded over ``shard x cp`` and the `Trainable`
            (``optimizer=`` is needed) splits each call's sequences over the cp ranks
            (`annot.runtime.context_parallel`). A mesh that does not cover the world is
            refused unless the model's parameters are already DTensors over the rest.
        cp_attention: how attention is split over a ``"cp"`` dimension: ``"allgather"``
            (each rank gathers the whole sequence's keys and values, any head count) or
            ``"ulysses"`` (an all-to-all over heads: each rank attends over the whole
            sequence for heads/cp heads; query heads must divide by cp).
        tp_plan: what tensor parallelism splits: ``None`` the model's own plan (a
            transformers model's ``_tp_plan``), `annot.tp_rule` (Linear layers by name),
            or a mapping of module patterns to styles (transformers' form). Only with a
            ``"tp"`` dimension of more than one rank.
    """

    reshard_after_forward: bool = True
    offload: bool | str | None = None
    offload_activations: bool = False
    mixed_precision: MixedPrecisionPolicy | torch.dtype | str | None = None
    mesh: MeshLike | None = None
    tp_plan: TPSource = None
    cp_attention: str = "allgather"

    def __post_init__(self) -> None:
        if self.cp_attention not in ATTENTIONS:
            raise ValueError(f"fsdp2: cp_attention={self.cp_attention!r}: choose one of "
                             f"{sorted(ATTENTIONS)}")
        object.__setattr__(self, "offload", resolve_torch_offload(self.offload, "fsdp2"))
        object.__setattr__(self, "mixed_precision", resolve_dtype(self.mixed_precision))
        # What is known here; a mesh from the Plan's parallel dims is checked in `check`.
        if self.tp_plan is not None and (
                isinstance(self.mesh, DeviceMesh) and TP_DIM not in (self.mesh.mesh_dim_names or ())
                or isinstance(self.mesh, ParallelDims) and self.mesh.tp == 1):
            raise ValueError(_TP_PLAN_NEEDS_TP)


_TP_PLAN_NEEDS_TP = (
    f"fsdp2: tp_plan= needs mesh= with a '{TP_DIM}' dimension of more than one rank to split "
    f"over, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=('shard', '{TP_DIM}')) or "
    "annot.ParallelDims(tp=2)")


class FSDP2(Engine[FSDP2Options]):
    """torch FSDP2: each unit sharded in place by ``fully_shard``; returns the model."""

    name = "fsdp2"
    Options = FSDP2Options

    hints = {
        "stage": "FSDP2 says it with reshard_after_forward=True (ZeRO-3-like) or False "
                 "(ZeRO-2-like)",
        "config": "config= is DeepSpeed's (engine='deepspeed')",
    }

    def __init__(self) -> None:
        #: The data-parallel and tensor-parallel meshes `check` resolved (``None``: every
        #: rank, 1-D; no tensor parallelism), and the tensor-parallel plan it checked.
        self.mesh: DeviceMesh | None = None
        self.tp_mesh: DeviceMesh | None = None
        self.tp_plan: TensorParallelPlan | None = None
        #: The context-parallel dimension (``None``: none, or one of a single rank).
        self.cp_mesh: DeviceMesh | None = None
        #: Expert parallelism (``ParallelDims(ep=N)``; ``None``: experts are sharded like
        #: any other parameter).
        self.experts: ExpertLayout | None = None

    def check(self, model: nn.Module, request: WrapRequest, options: FSDP2Options) -> None:
        plan = request.plan
        if options.offload is None:  # the Plan decides what is offloaded
            refuse_nvme_marks(plan, self.name)
        refuse_fsdp2_dtypes(model, plan)
        refuse_computing_outside_forward(model, self.name)
        refuse_scalar_parameters(model, self.name)
        refuse_bitsandbytes_parameters(model, self.name)
        mesh = resolve_mesh(options.mesh, plan.parallel, request.device.type, self.name,
                            expert_parallel=True)
        dims = requested_dims(options.mesh, plan.parallel)
        if dims is not None and mesh is not None:
            self.experts = check_expert_parallel(
                model, dims, dist.get_world_size(), request.device.type,
                mixed_precision_policy(cast("MixedPrecisionPolicy | torch.dtype | None",
                                            options.mixed_precision)))
        if mesh is not None:
            self.mesh, self.tp_mesh = split_mesh(mesh)
            if self.mesh.ndim == 2 and self.mesh.mesh_dim_names is None:
                # torch 2.13's fully_shard asserts on an unnamed 2-D mesh.
                raise ValueError(
                    "fully_shard needs a 2-D (HSDP) mesh's dimensions named: build it with "
                    "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')), or pass "
                    "mesh=annot.ParallelDims(replicate=...)")
            refuse_unsynchronised_mesh(model, mesh)
            self.cp_mesh = context_parallel_mesh(mesh)
            if self.cp_mesh is not None:
                refuse_unsplittable(model, self.cp_mesh.size(), options.cp_attention)
        if self.tp_mesh is not None:
            self.tp_plan = check_tensor_parallel(model, options.tp_plan, self.tp_mesh.size())
        elif options.tp_plan is not None:
            raise ValueError(_TP_PLAN_NEEDS_TP)

    def prepare(self, model: nn.Module, request: WrapRequest, options: FSDP2Options,
                checkpoint_paths: Sequence[str]) -> None:
        if self.tp_mesh is not None and self.tp_plan is not None:
            # before checkpointing and sharding (torchtitan's order)
            apply_tensor_parallel(model, self.tp_plan, self.tp_mesh)
        if self.experts is not None:  # before checkpointing and sharding, as tensor parallelism
            self.experts.apply(model)
        # The Plan's offload marks mean parameter offload here; activation offload is asked
        # for explicitly.
        checkpoint_and_offload_activations(model, request.plan, checkpoint_paths,
                                           options.offload_activations)

    def optimizer_needed(self) -> str | None:
        if self.cp_mesh is None:
            return None
        return ("context parallelism (a 'cp' mesh dimension) needs optimizer=: the Trainable "
                "splits each call's sequences and reduces the loss over the cp ranks")

    def trainable(self, wrapped: nn.Module, model: nn.Module, optimizer: OptimizerFactory,
                  options: FSDP2Options, *, device: torch.device | None = None) -> Trainable:
        trainable = super().trainable(wrapped, model, optimizer, options, device=device)
        if self.cp_mesh is not None:
            trainable.context_parallel = ContextParallel(self.cp_mesh.get_group(), model,
                                                         options.cp_attention)
        return trainable

    def loss_scaler(self, options: FSDP2Options, device: torch.device) -> ShardedGradScaler | None:
        # Sharded: each rank sees only its shards' gradients, so an inf on one rank must
        # skip the step on all (the scaler all-reduces what it found).
        return ShardedGradScaler(device.type, init_scale=INIT_SCALE) if is_fp16(options.mixed_precision) else None

    def wrap(self, model: nn.Module, request: WrapRequest, options: FSDP2Options) -> nn.Module:
        return apply_fsdp2(
            # __post_init__ resolved offload to None/True/False and a name ("bf16") to a dtype
            model, request.plan, offload=cast("bool | None", options.offload),
            mixed_precision=cast("MixedPrecisionPolicy | torch.dtype | None", options.mixed_precision),
            reshard_after_forward=options.reshard_after_forward, mesh=self.mesh,
            device=request.device, experts=self.experts,
            before_shard=request.load_from.fill_before_sharding if request.load_from is not None else None)

    def state(self, trainable: Trainable) -> EngineState:
        """torch's distributed state-dict API, which gives the layout as it is."""
        return TorchState(trainable)


def holds_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it is already sharded with ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def refuse_unsynchronised_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Refuse a mesh on which some ranks would train copies nothing synchronises.

    FSDP2 reduces gradients over ``mesh`` only. A mesh smaller than the world (Lightning's
    ``ModelParallelStrategy()`` defaults give a data-parallel mesh of size 1 on one node)
    leaves the ranks outside it training their own copies, silently (measured: loss off
    by 6.8e-2 after 4 steps on 2 ranks). It is right only when another parallelism the
    model already carries covers the rest: parameters that are DTensors on a mesh
    (tensor parallelism applied before annot) whose size times ``mesh``'s is the world.
    """
    world = dist.get_world_size()
    size = mesh.size()
    if size == world:
        return
    others = {p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)}
    if len(others) == 1 and size * others.pop() == world:
        return
    dims = "x".join(str(n) for n in mesh.mesh.shape)
    raise ValueError(
        f"mesh={dims} ({size} rank{'s' if size != 1 else ''}, names {mesh.mesh_dim_names}) does "
        f"not cover the {world} ranks of the world and the model has no other parallelism "
        "over the rest: those ranks would train unsynchronised copies. Omit mesh= (annot "
        "shards over all ranks), or pass a mesh over every rank, e.g. "
        f"init_device_mesh('{mesh.device_type}', ({world},)); with Lightning's "
        f"ModelParallelStrategy pass data_parallel_size={world}, tensor_parallel_size=1 "
        "(or use annot.lightning.Strategy, which does)")


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


def _offload_policy(offload: bool, pin: bool) -> OffloadPolicy:
    return CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy()


def pin_offloaded_state(plan: Plan, offload: bool | None, device: torch.device, world: int) -> bool:
    """Whether FSDP2's offloaded parameters and gradients (this rank's shard of each
    offloaded unit: 2 x its bytes / ``world``) go to pinned host memory: only for a GPU
    (faster host-to-GPU copies; there is none to copy to on the CPU) and within the
    rank's pinned budget, else pageable with a warning (docs/design.md, pitfall 44)."""
    units = [u for u in plan.units if u.has(Action.SHARD) and _unit_offloads(u, offload)]
    held = sum(sum(u.bytes.values()) for u in units)
    if offload:
        held += sum(plan.root.bytes.values())
    if device.type != "cuda" or held == 0:
        return False
    return pin_host_memory(2 * held // max(1, world), "FSDP2's offloaded parameters and gradients",
                           device=device)


def _unit_offloads(unit: Unit, offload: bool | None) -> bool:
    return unit.has(Action.OFFLOAD) if offload is None else offload


def apply_fsdp2(
    model: nn.Module,
    plan: Plan,
    *,
    offload: bool | None,
    mixed_precision: MixedPrecisionPolicy | torch.dtype | None,
    reshard_after_forward: bool,
    mesh: DeviceMesh | None,
    device: torch.device,
    experts: ExpertLayout | None = None,
    before_shard: Callable[[Sequence[nn.Module]], None] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 following ``plan``; returns ``model``.

    ``before_shard`` (a load's `CheckpointSource.fill_before_sharding`) is called with
    each unit's modules just before they are sharded, then with the whole model.

    ``offload`` is parameter offload (FSDP2's ``CPUOffloadPolicy``: parameters, gradients
    and optimizer state on CPU): ``None`` for the units the Plan marks, ``True`` every
    unit and the root, ``False`` none. Run-time checkpointing and activation offload are
    installed before this (`FSDP2.prepare`).
    ``reshard_after_forward``: ``True`` frees gathered parameters after each unit's
    forward (ZeRO-3-like), ``False`` keeps them until backward (ZeRO-2-like). The root is
    left to FSDP2, which does not reshard it: backward needs it at once.
    ``experts`` (expert parallelism): each experts module is sharded first, over the
    ranks holding its experts (`annot.engines.fsdp2_experts`); a unit that is an experts
    module is then already sharded.
    """
    # A "tp" dimension was applied in `FSDP2.prepare`; FSDP2 shards over the rest.
    mesh = split_mesh(mesh)[0] if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    mp_policy = mixed_precision_policy(mixed_precision)
    # The mesh's last dimension is the one FSDP2 shards over (pitfall 25).
    pin = pin_offloaded_state(plan, offload, device, mesh.shape[-1])

    # Tensors that hold values before sharding (weights quantized on load) are filled
    # unit by unit, just before each unit is sharded; on one rank, all at once (they
    # stay whole: `_left_whole_quantized`), and with expert parallelism too.
    fill = before_shard or (lambda modules: None)
    if mesh.shape[-1] == 1 or experts is not None:
        fill([model])
    # A parameter without elements (NucleusMoE's tiny dense MLP of width 0) has nothing to
    # shard or reduce, and FSDP2's reduce-scatter copy fails on it ("_chunk_cat expects
    # non-empty tensor"): FSDP2 leaves it a plain tensor.
    empty = {p for p in model.parameters() if p.numel() == 0}
    empty |= _left_whole_quantized(model, mesh, device)
    sharded_experts = set(experts.plan.experts) if experts is not None else set()
    if experts is not None:
        def experts_offload(path: str) -> OffloadPolicy:
            # As the innermost shard unit that is or holds the experts module.
            holders = [(len(m), u) for u in plan.units if u.has(Action.SHARD) for m in u.modules
                       if path == m or path.startswith(m + ".")]
            holder = max(holders, key=lambda h: h[0])[1] if holders else None
            offloads = _unit_offloads(holder, offload) if holder is not None else bool(offload)
            return _offload_policy(offloads, pin)

        shard_experts(model, experts, reshard_after_forward=reshard_after_forward,
                      mp_policy=mp_policy, offload_policy=experts_offload)
    for unit in plan.units:
        if not unit.has(Action.SHARD):
            continue
        if set(unit.modules) <= sharded_experts:
            continue
        modules = [model.get_submodule(path) for path in unit.modules]
        fill(modules)
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=_offload_policy(_unit_offloads(unit, offload), pin),
            ignored_params=empty or None,
        )
        if len(modules) == 1:
            register_entry_methods(modules[0])
    for unit in plan.units:  # once every unit is one: each hooks only its own parts
        if unit.has(Action.SHARD) and not set(unit.modules) <= sharded_experts:
            gather_on_outside_calls([model.get_submodule(path) for path in unit.modules])

    fill([model])
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=_offload_policy(bool(offload), pin),
        ignored_params=empty or None,
    )
    register_entry_methods(model)
    return model


def _left_whole_quantized(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> set[nn.Parameter]:
    """Frozen quantized weights (a tensor type with its own all-gather hooks, torchao's
    NF4) when FSDP2 shards over one rank: there is nothing to split or gather, and
    FSDP2's one-rank path hands the hooks one output where NF4's expect three. They stay
    whole, out of FSDP2, moved to ``device`` here (FSDP2 moves only what it manages)."""
    if mesh.shape[-1] != 1:
        return set()
    kept = set()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad and hasattr(param, "fsdp_pre_all_gather"):
                if param.device != device:
                    param = nn.Parameter(param.to(device), requires_grad=False)
                    module._parameters[name] = param
                kept.add(param)
    return kept


def gather_on_outside_calls(modules: list[nn.Module]) -> None:
    """Make a call of a part of the unit ``modules`` form (a submodule owning
    parameters, not inside a nested unit) gather the unit's parameters when they are
    sharded: a model that calls a unit's part from outside the unit's forward (DiT's
    ``transformer_blocks[0].norm1.emb`` from the model's forward, Kosmos-2's
    ``vision_model.model.post_layernorm`` from ``get_image_features``) otherwise
    computes with a shard ("got mixed torch.Tensor and DTensor"). Inside the unit's
    forward (or its recomputation) the parameters are gathered already and the call
    does nothing. Gathered this way they stay so until the unit's post-backward
    reduces their gradients (the outside call's included) and reshards them, or until
    the root's final post-backward callback does for a unit whose forward did not run;
    every rank makes the same calls, so the gathers pair. A part called before the
    unit's forward has its backward after the unit's post-backward, which has reduced
    the unit's gradients: a hook on its output raises then (`_refuse_late_gradient`,
    design pitfall 61) rather than lose its gradient."""
    owner = cast(FSDPModule, modules[0])
    outside: set[nn.Module] = set()  # parts called outside the unit's forward, until they return

    def gatherer(name: str) -> Callable[..., None]:
        def gather(part: nn.Module, _: Any) -> None:
            # Gathered, FSDP2 registers plain tensors: the check costs far less than
            # the no-op ``unshard`` (22 us a call here), run for every part each forward.
            param = part._parameters.get(name)
            if param is None:  # moved since (PEFT's target_parameters parametrizes it)
                owner.unshard()  # nothing to tell by: gathers if sharded, else nothing
            elif isinstance(param, DTensor):
                owner.unshard()
                outside.add(part)
        return gather

    def watch(part: nn.Module, _: Any, output: Any) -> None:
        if part not in outside:
            return
        outside.discard(part)
        first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(lambda _grad: _refuse_late_gradient(owner, part))

    def parts(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            if isinstance(child, FSDPModule):  # a nested unit gathers its own
                continue
            yield child
            yield from parts(child)

    for module in modules:
        for part in parts(module):
            name = next((n for n, p in part._parameters.items() if p is not None and p.numel()), None)
            if name is not None:
                part.register_forward_pre_hook(gatherer(name))
                part.register_forward_hook(watch)


def _refuse_late_gradient(unit: FSDPModule, part: nn.Module) -> None:
    """Raise when the gradient of a part called outside its unit's forward arrives after
    the unit's post-backward reduced the unit's gradients: the part's would be lost
    (called before the unit's forward, its backward comes after the unit's). An
    embedding's backward does not read its weight, so nothing else would fail."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    if any(group is not None and group._training_state == TrainingState.POST_BACKWARD for group in groups):
        raise EngineNotAvailableError(
            f"{type(part).__name__} inside the FSDP2 unit {type(unit).__name__.removeprefix('FSDP')} is called "
            "outside that unit's forward and before it, so its gradient comes after FSDP2 reduced the "
            "unit's: it would be lost. Make the part (or the module holding it) not a unit of its own "
            "(a policy override), or call it inside the unit's forward (docs/design.md, pitfall 61)")


def register_entry_methods(module: nn.Module) -> None:
    """Make ``module``'s (a unit's or the root's) methods of `ENTRY_METHODS` gather its
    parameters as its ``forward`` does. A unit is called that way too: Chameleon's and
    Emu3's image tokenizer (a unit) through ``encode``, from the model's forward."""
    for name in ENTRY_METHODS:
        if callable(getattr(type(module), name, None)):
            register_fsdp_forward_method(module, name)


#: Methods called on a model or a unit instead of ``forward`` (a diffusers VAE's ``encode``
#: and ``decode``, CLIP's ``get_text_features``, a VLM's image tokenizer's ``encode``):
#: FSDP2 gathers a module's parameters in its forward hooks only, so each is registered
#: to run them too (called bare, the parameters were still sharded: "got mixed
#: torch.Tensor and DTensor").
ENTRY_METHODS = ("encode", "decode", "get_text_features", "get_image_features", "get_audio_features",
                 "get_video_features")

