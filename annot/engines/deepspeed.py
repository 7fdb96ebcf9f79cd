"""DeepSpeed ZeRO driven by a Plan.

The engine contract's steps (`annot.engines.base`) for DeepSpeed:
1. `DeepSpeed.prepare`: ``deepspeed.checkpointing.configure`` with the config, without
   which DeepSpeed ignores the config's ``activation_checkpointing`` section
   (docs/design.md, pitfall 9); the Plan's modules checkpointed at run time with
   DeepSpeed's checkpoint, so partitioned and CPU activation checkpoints apply (module
   names unchanged, as with torch engines); ZeRO-3 leaf modules marked (``leaf_modules``,
   e.g. MoE blocks, whose experts run in a different order each step): ZeRO-3 then
   gathers a leaf's parameters all at once when the leaf is entered instead of hooking
   its submodules, which must happen before ``deepspeed.initialize`` installs those hooks.
   Without ``leaf_modules`` the Plan's MoE blocks (`annot.policies.experts`) are the
   leaves, so routing that differs across ranks cannot leave ranks waiting on each
   other's gathers;
2. `DeepSpeed.wrap`: a model built under `annot.meta_init` is, with ZeRO-3, allocated
   and partitioned one unit at a time (``deepspeed.zero.Init(module=unit)``);
3. `DeepSpeed.fill`: the partitions (or, with ZeRO-1/2, the whole parameters) get their
   values from the construction record or a checkpoint, before ``initialize`` copies
   them into the optimizer's master weights;
4. `DeepSpeed.trainable`: ``deepspeed.initialize``; ZeRO partitions what the stage says
   and builds the optimizer from the parameters it now manages. The optimizer is a
   factory DeepSpeed calls, so it cannot be built on the parameters before partitioning.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from annot.engines.base import (
    CheckpointFunction,
    Engine,
    EngineState,
    OptimizerFactory,
    RenamedOption,
    Trainable,
    WrapRequest,
    refuse_plan_activation_choices,
    resolve_dtype,
    trained_parameters,
)
from annot.engines.checks import refuse_computing_outside_forward, require_process_group
from annot.engines.deepspeed_config import deepspeed_config
from annot.engines.deepspeed_cpu_adam import host_optimizer_factory
from annot.engines.deepspeed_partitions import (
    partition_range,
    refresh_secondary_partitions,
    shard_layout,
)
from annot.engines.dtypes import refuse_deepspeed_dtypes
from annot.engines.mesh import build_mesh, context_parallel_mesh, refuse_plan_dims
from annot.meta.layout import ShardLayout
from annot.meta.unit_allocation import UnitAllocator
from annot.policies import Action, Plan, Rule
from annot.policies.model_index import ModelIndex
from annot.policies.parallel import ParallelDims
from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.runtime.context_parallel import ATTENTIONS, ContextParallel, refuse_unsplittable

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DeepSpeed",
    "DeepSpeedOptions",
    "DeepSpeedTrainable",
    "LeafModules",
    "deepspeed_checkpoint",
    "partition_range",
    "partition_unit_by_unit",
    "refresh_secondary_partitions",
    "refuse_other_accelerator",
    "set_leaf_modules",
    "set_moe_leaves",
    "shard_layout",
]

# Classes (or class names, as DeepSpeed takes them) or a rule selecting module instances.
LeafModules = Rule | Sequence[type[nn.Module] | str]


def deepspeed_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.checkpointing.checkpoint`` with the output's shape kept.

    DeepSpeed's checkpoint is reentrant (the gradient flows only if an input tensor
    requires grad, as a block's hidden state does) and returns a bare tensor where the
    function returned a 1-tuple (docs/design.md, pitfall 9); the 1-tuple is restored here, and a
    call whose inputs need no gradient (positional or keyword) is not checkpointed.
    """
    import deepspeed

    if torch.is_grad_enabled() and not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        # Reentrant checkpointing cuts the graph when no input requires grad (an embeddings
        # unit fed token ids or pixels): its parameters, and every parameter before the
        # next such unit, would silently get no gradient. Such a unit runs plainly.
        return function(*args, **kwargs)
    one_tuple = False

    def run(*a: Any, **k: Any) -> Any:
        nonlocal one_tuple
        out = function(*a, **k)
        one_tuple = isinstance(out, tuple) and len(out) == 1
        return out

    out = deepspeed.checkpointing.checkpoint(run, *args, **kwargs)
    return (out,) if one_tuple else out


def set_leaf_modules(model: nn.Module, leaf_modules: LeafModules) -> list[str]:
    """Mark the modules ``leaf_modules`` selects as ZeRO-3 leaves; returns their paths.

    Classes and class names go to ``deepspeed.utils.set_z3_leaf_modules`` (instances of a
    class and of its subclasses); a rule (``annot.by_name("*.experts")``) marks exactly the
    module instances it selects. Selecting nothing is a `ValueError`.
    """
    from deepspeed.utils import set_z3_leaf_module, set_z3_leaf_modules

    if isinstance(leaf_modules, Rule):
        paths = list(leaf_modules.select(ModelIndex(model)))
        for path in paths:
            set_z3_leaf_module(model.get_submodule(path), True)
    else:
        if isinstance(leaf_modules, (str, type)):
            leaf_modules = [leaf_modules]
        chosen = {id(m) for m in set_z3_leaf_modules(model, list(leaf_modules), raise_if_not_found=False)}
        paths = [path for path, m in model.named_modules() if id(m) in chosen]
    if not paths:
        raise ValueError(
            f"leaf_modules={leaf_modules!r} selects no module of {type(model).__name__}: "
            "pass the MoE block's class (or its name), or a rule such as by_name('*.moe')"
        )
    return paths


def set_moe_leaves(model: nn.Module, paths: Sequence[str]) -> None:
    """Mark the MoE blocks at ``paths`` (the Plan's) as ZeRO-3 leaves, and say so.

    Each rank runs only the experts its tokens are routed to, in its own order, while
    ZeRO-3 gathers a module's parameters in a collective when the module is entered and
    prefetches along the order it traced: with per-expert modules, ranks routing
    differently then wait on different gathers and hang. A leaf is gathered whole on
    entry (router, every expert, shared experts), which every rank does at the same
    point of the forward."""
    from deepspeed.utils import set_z3_leaf_module

    for path in paths:
        set_z3_leaf_module(model.get_submodule(path), True)
    logging.getLogger("annot").info(
        "ZeRO-3: %d MoE block(s) gathered whole as leaf modules (%s%s); pass leaf_modules= "
        "to choose others", len(paths), ", ".join(paths[:3]), ", ..." if len(paths) > 3 else "")


def _no_leaves(leaf_modules: LeafModules) -> bool:
    """``leaf_modules=()`` (or ``[]``): no leaves at all, not even the Plan's MoE blocks."""
    return not isinstance(leaf_modules, (Rule, str, type)) and len(leaf_modules) == 0


_DEEPSPEED_PRECISION = {None: None, torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """Options of ``engine="deepspeed"`` (needs ``optimizer=``, a factory DeepSpeed calls).

    Args:
        stage: the ZeRO stage, 1-3 (3 partitions parameters; default 3).
        offload: ``None`` as the Plan marks, ``"none"``/``False``, ``"cpu"``/``True`` or
            ``"nvme"`` (needs ``nvme_path``); stage 3 offloads parameters too unless
            ``offload_params=False``.
        offload_params: with stage 3 and ``offload``, whether parameters go with the
            optimizer state (``None``/``True``) or stay on the GPU (``False``: ZeRO-3 with
            only the optimizer offloaded).
        nvme_path: a directory on a fast local disk, for ``offload="nvme"``.
        mixed_precision: ``None``, ``"bf16"`` or ``"fp16"`` (or the dtype).
        config: a whole DeepSpeed config to use instead of the one
            `annot.deepspeed_config` writes from the options above (then leave them out).
        leaf_modules: ZeRO-3 leaves (classes, class names, or a rule selecting module
            instances), gathered whole on entry, and no others. ``None``: the Plan's MoE
            blocks (`annot.policies.experts`), if any, plus those DeepSpeed's own config
            defaults name (``zero_optimization.leaf_module``); ``()``: none at all.
        cpu_adam: with the optimizer state offloaded, whether DeepSpeed's CPU Adam steps
            in place of torch's Adam/AdamW (`annot.engines.deepspeed_cpu_adam`): ``None``
            where DeepSpeed's accelerator is a GPU, with a warning naming the cost when
            it cannot be built; ``True`` on any accelerator, an error when it cannot be
            built; ``False`` keeps the optimizer the factory returns.
        hpz_partition_size, quantized_weights, quantized_gradients: ZeRO++ for stage 3
            (`annot.deepspeed_config`): hierarchical partitioning over groups of N
            consecutive ranks (a node), quantized weight / gradient collectives (GPU only).
        mesh: `annot.ParallelDims` with ``cp`` (context parallelism: each sequence split
            over groups of ``cp`` consecutive ranks, `annot.runtime.context_parallel`);
            ZeRO still partitions over every rank, and a device mesh or other dimensions
            are refused (DeepSpeed takes none).
        cp_attention: how attention is split over the cp ranks: ``"allgather"`` (annot's
            all-gather of keys and values, the default) or ``"ulysses"`` (all-to-all over
            heads through DeepSpeed's ``DistributedAttention``,
            `annot.engines.deepspeed_ulysses`).
    """

    stage: int | None = None
    offload: bool | str | None = None
    offload_params: bool | None = None
    nvme_path: str | None = None
    mixed_precision: torch.dtype | str | None = None
    config: dict[str, Any] | None = None
    leaf_modules: LeafModules | None = None
    cpu_adam: bool | None = None
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    mesh: ParallelDims | None = None
    cp_attention: str = "allgather"

    def __post_init__(self) -> None:
        if self.mesh is not None and not isinstance(self.mesh, ParallelDims):
            raise TypeError(
                f"engine 'deepspeed' takes mesh=annot.ParallelDims(cp=N) (context parallelism), "
                f"not a {type(self.mesh).__name__}: ZeRO partitions over every rank; for "
                "partitions within a node pass hpz_partition_size=N (ZeRO++ hpZ)")
        if self.cp_attention not in ATTENTIONS:
            raise ValueError(f"deepspeed: cp_attention={self.cp_attention!r}: choose one of "
                             f"{sorted(ATTENTIONS)}")
        object.__setattr__(self, "offload", {True: "cpu", False: "none"}.get(self.offload, self.offload))  # type: ignore[arg-type]
        dtype = resolve_dtype(self.mixed_precision)
        if dtype not in _DEEPSPEED_PRECISION:
            raise ValueError(
                f"engine 'deepspeed' takes mixed_precision 'bf16', 'fp16' or None, not {dtype!r}")
        object.__setattr__(self, "mixed_precision", dtype)
        if self.config is not None and (self.offload is not None or dtype is not None
                                        or self.stage is not None or self.nvme_path
                                        or self.offload_params is not None
                                        or self.hpz_partition_size != 1 or self.quantized_weights
                                        or self.quantized_gradients):
            raise ValueError(
                "engine 'deepspeed' with config=: set stage, offload, precision and ZeRO++ in the "
                "config (annot.deepspeed_config(..., stage=..., offload=..., precision=..., "
                "hpz_partition_size=...)), not here")


def _stage_of_reshard(reshard_after_forward: Any) -> int:
    """The ZeRO stage ``reshard_after_forward`` meant before 0.2.0."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"engine 'deepspeed': reshard_after_forward (deprecated: use stage=) "
                        f"takes True or False, not {reshard_after_forward!r}")
    return 3 if reshard_after_forward else 2


class DeepSpeed(Engine[DeepSpeedOptions]):
    """DeepSpeed ZeRO 1-3; `trainable` runs ``deepspeed.initialize``."""

    name = "deepspeed"
    maps_checkpoint = False
    Options = DeepSpeedOptions
    #: DeepSpeed builds the optimizer itself, from a factory, after partitioning.
    requires_optimizer = True

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}
        self.cpu_adam: bool | None = None
        #: The context-parallel group's ranks (``None``: no context parallelism).
        self.cp_mesh: DeviceMesh | None = None

    # Until 0.2.0 auto_wrap took reshard_after_forward for every engine; for DeepSpeed it
    # chose the stage (True: 3, the default then; False: 2) when config= was not given.
    deprecated_options = {"reshard_after_forward": RenamedOption("stage", _stage_of_reshard)}

    hints = {
        "offload_activations": "use DeepSpeed's own annot.deepspeed_config(..., "
                               "cpu_checkpointing=True) as config=",
    }

    def gathers_in_module_order(self) -> bool:
        return self.stage == 3

    def check(self, model: nn.Module, request: WrapRequest, options: DeepSpeedOptions) -> None:
        plan = request.plan
        refuse_deepspeed_dtypes(model)
        # DeepSpeed's checkpoint is reentrant (no selective contexts); its activation
        # offload is its own cpu_checkpointing.
        refuse_plan_activation_choices(plan, self.name, selective=False, offload=False)
        dims = _parallel_dims(options.mesh, plan.parallel)
        refuse_plan_dims(dims, self.name,
                         "ZeRO partitions over every rank; for partitions within a node pass "
                         "hpz_partition_size=N (ZeRO++ hpZ), or use engine='fsdp2' or 'fsdp1'",
                         context_parallel=True)
        if dims is not None and dims.cp != 1:
            require_process_group(self.name)
            # (shard, cp): cp innermost, so a cp group is consecutive ranks, as FSDP2's.
            self.cp_mesh = context_parallel_mesh(build_mesh(dims, request.device.type))
            if self.cp_mesh is not None:
                refuse_unsplittable(model, self.cp_mesh.size(), options.cp_attention)
        self.config = options.config if options.config is not None else deepspeed_config(
            plan, stage=3 if options.stage is None else options.stage,
            # casts: __post_init__ made offload a str (or None), mixed_precision a dtype (or None)
            offload=cast("str | None", options.offload),
            offload_params=options.offload_params,
            nvme_path=options.nvme_path,
            precision=_DEEPSPEED_PRECISION[cast("torch.dtype | None", options.mixed_precision)],
            hpz_partition_size=options.hpz_partition_size,
            quantized_weights=options.quantized_weights,
            quantized_gradients=options.quantized_gradients)
        self.cpu_adam = options.cpu_adam
        stage = self.stage
        if stage == 3:
            refuse_computing_outside_forward(model, f"{self.name} ZeRO-3")
        if options.leaf_modules is not None and stage != 3:
            raise ValueError(
                f"leaf_modules is a ZeRO-3 setting, but the ZeRO stage is {stage}: use stage=3 "
                "or drop leaf_modules")
        if options.leaf_modules is not None and options.config is None:
            # DeepSpeed 0.19 also marks leaves of its own at initialize (its config's
            # zero_optimization.leaf_module defaults name Mixtral's and Qwen2/3-MoE's
            # blocks): leaf_modules= given means exactly those, so the config names none.
            self.config["zero_optimization"]["leaf_module"] = {
                "classes": [], "names": [], "name_suffixes": []}
        refuse_other_accelerator(request.device)  # last: it imports DeepSpeed

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def checkpoint_paths(self, model: nn.Module, plan: Plan, choice: bool | None) -> list[str]:
        paths = _without_shared_parameters(model, super().checkpoint_paths(model, plan, choice))
        return _without_recorded_router_logits(model, plan, paths)

    def prepare(self, model: nn.Module, request: WrapRequest, options: DeepSpeedOptions,
                checkpoint_paths: Sequence[str]) -> None:
        import deepspeed
        import torch.distributed as dist

        # DeepSpeed keeps its own communication backend; it wraps the process group torch
        # already has, and `configure` below needs it before `initialize` would set it up.
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        if checkpoint_paths:
            deepspeed.checkpointing.configure(None, deepspeed_config=self.config)
        apply_checkpointing(model, checkpoint_paths, self.checkpoint_function())
        if options.leaf_modules is not None:
            if not _no_leaves(options.leaf_modules):
                set_leaf_modules(model, options.leaf_modules)
        elif self.stage == 3 and request.plan.moe:
            set_moe_leaves(model, [block.path for block in request.plan.moe])

    def wrap(self, model: nn.Module, request: WrapRequest, options: DeepSpeedOptions) -> nn.Module:
        if request.deferred and self.stage == 3 and not _params_swapped_to_nvme(self.config):
            unit_paths = [m for u in request.plan.units if u.has(Action.SHARD) for m in u.modules]
            partition_unit_by_unit(model, unit_paths, self.config, request.device)
        return model

    def layout(self, wrapped: nn.Module) -> ShardLayout:
        return shard_layout(wrapped)

    def fill(self, wrapped: nn.Module, request: WrapRequest) -> None:
        super().fill(wrapped, request)
        refresh_secondary_partitions(wrapped)

    def after_write(self, model: nn.Module) -> None:
        """ZeRO++ hpZ's secondary partitions were cut from the values before the write:
        drop them (docs/design.md, pitfall 27)."""
        refresh_secondary_partitions(model)

    def checkpoint_function(self) -> CheckpointFunction:
        """DeepSpeed's checkpoint, so the config's ``partition_activations`` and
        ``cpu_checkpointing`` apply."""
        return deepspeed_checkpoint

    def state(self, trainable: Trainable) -> EngineState:
        from annot.engines.deepspeed_state import DeepSpeedState

        return DeepSpeedState(trainable)

    def trainable(self, wrapped: nn.Module, model: nn.Module, optimizer: OptimizerFactory,
                  options: DeepSpeedOptions, *, device: torch.device | None = None) -> Trainable:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        optimizer = host_optimizer_factory(optimizer, self.config, choice=self.cpu_adam,
                                           on_gpu=get_accelerator().device_name() != "cpu")
        # DeepSpeed takes its GPU from LOCAL_RANK unless told (an invalid ordinal under srun
        # with one GPU per task): ``device_rank`` is the one annot chose.
        args = SimpleNamespace(device_rank=device.index) if device is not None and device.type == "cuda" else None
        engine, ds_optimizer, *_ = deepspeed.initialize(
            args=args, model=wrapped, optimizer=optimizer,
            model_parameters=trained_parameters(wrapped), config=self.config)
        # DeepSpeed's engine leaves inputs where they are: the Trainable moves them.
        trainable = DeepSpeedTrainable(engine, model, ds_optimizer, self.name, device=device)
        if self.cp_mesh is not None:
            from annot.engines.deepspeed_ulysses import deepspeed_ulysses_attention

            ulysses = deepspeed_ulysses_attention if options.cp_attention == "ulysses" else None
            trainable.context_parallel = ContextParallel(
                self.cp_mesh.get_group(), model, options.cp_attention, function=ulysses)
        return trainable


class DeepSpeedTrainable(Trainable):
    """The ``DeepSpeedEngine`` behind the shared surface: its ``backward`` (loss scaling,
    gradient accumulation) and ``step``, which also clears the gradients."""

    def _backward(self, loss: torch.Tensor) -> None:
        # Trainable.backward around it: the attention split again for recomputation.
        self.module.backward(loss)  # type: ignore[operator]

    def step(self) -> None:
        self.module.step()  # type: ignore[operator]

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed's ``step`` clears the gradients at each boundary."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Refused: DeepSpeed clips inside its ``step``, on gradients it unscaled and
        reduced itself; a clip between ``backward`` and ``step`` would see its partial,
        scaled ones."""
        raise ValueError(
            "engine 'deepspeed' clips gradients inside its step: set it in the config "
            f"(annot.deepspeed_config(..., gradient_clipping={max_norm}) as config=, or "
            "\"gradient_clipping\" in your own), not with Trainable.clip_grad_norm_")


def refuse_other_accelerator(device: torch.device) -> None:
    """DeepSpeed computes on its accelerator (CUDA when torch sees a GPU, unless
    ``DS_ACCELERATOR`` says otherwise), whatever annot chose: refuse the CPU where that
    accelerator is a GPU (a gloo process group on a GPU machine keeps annot on the CPU,
    pitfall 36) before the model changes, instead of a model on the GPU fed CPU batches.
    A GPU device with DeepSpeed's CPU accelerator passes: that is a GPU plan checked on a
    machine without one (`annot.memory`'s strategy calls); a run there stops at
    `annot.devices.choose_device` first."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if device.type == "cpu" and accelerator != "cpu":
        raise ValueError(
            f"engine 'deepspeed' computes on its {accelerator!r} accelerator, but the device is "
            f"{device}: pass device={accelerator!r} to auto_wrap (a gloo process group keeps "
            "annot on the CPU unless asked), or set DS_ACCELERATOR=cpu before DeepSpeed is "
            "imported")


def _without_shared_parameters(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` less the modules holding a parameter also used outside them (a tied
    embedding and head). DeepSpeed's checkpoint is reentrant: its recomputation runs a
    backward of its own, so such a parameter's gradient hook fires twice in one step and
    ZeRO-3 stops on a duplicate in its reduce bucket. Dropped paths are logged."""
    holders: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), set()).add(name.rpartition(".")[0])
    shared = [mods for mods in holders.values() if len(mods) > 1]
    keep = []
    for path in paths:
        inside = [any(m == path or m.startswith(path + ".") for m in mods) for mods in shared]
        outside = [any(not (m == path or m.startswith(path + ".")) for m in mods) for mods in shared]
        if any(i and o for i, o in zip(inside, outside, strict=True)):
            logging.getLogger("annot").warning(
                "not checkpointing %s with DeepSpeed: it shares a parameter with a module "
                "outside it (tied weights), which reentrant checkpointing cannot handle", path)
        else:
            keep.append(path)
    return keep


def _without_recorded_router_logits(model: nn.Module, plan: Plan, paths: list[str]) -> list[str]:
    """``paths`` less the modules holding one of the Plan's MoE blocks, when the model
    records its routers' outputs for the load-balancing loss (transformers'
    ``output_router_logits=True``: forward hooks keep the router logits, and the loss is
    computed from them after the layers ran). DeepSpeed's checkpoint is reentrant: the
    checkpointed forward runs without autograd, so the recorded logits carry no gradient
    and the load-balancing term stops training the routers while the loss value stays
    the same (measured: tiny Mixtral, Qwen3-MoE and gpt-oss on 2 ranks, loss off from the
    second step; docs/design.md, pitfall 43). Dropped paths are logged."""
    config = getattr(model, "config", None)
    if not plan.moe or not getattr(config, "output_router_logits", False):
        return paths
    keep = []
    for path in paths:
        if any(block.path == path or block.path.startswith(path + ".") or not path
               for block in plan.moe):
            logging.getLogger("annot").warning(
                "not checkpointing %s with DeepSpeed: it holds an MoE block whose router "
                "logits the load-balancing loss reads (output_router_logits=True), and "
                "DeepSpeed's reentrant checkpoint would cut their gradient", path or "(root)")
        else:
            keep.append(path)
    return keep


def _params_swapped_to_nvme(config: dict[str, Any]) -> bool:
    """Whether ZeRO-3 swaps parameter partitions out to NVMe. Their ``ds_tensor`` is then
    on disk, not in memory, so the partitions cannot be filled in place after
    `partition_unit_by_unit`: such a model is materialized whole and partitioned by
    ``initialize`` instead (transient: the full model on every rank)."""
    offload = config.get("zero_optimization", {}).get("offload_param") or {}
    return offload.get("device") == "nvme"


def partition_unit_by_unit(model: nn.Module, unit_paths: Sequence[str], config: dict[str, Any],
                           device: torch.device) -> None:
    """ZeRO-3-partition a meta ``model`` one shard unit at a time: give a unit's tensors
    storage (values undefined), then ``deepspeed.zero.Init(module=unit)`` partitions its
    parameters at once and frees the full ones; deepest units first, the root's own
    parameters last. `annot.materialize` then fills each rank's partitions."""
    import deepspeed

    allocator = UnitAllocator(model, device)
    # Deepest first, so a unit nested in another is partitioned before its parent
    # allocates; "" (the root) takes whatever is left. Plan order otherwise, identical on
    # every rank: each zero.Init call is collective and numbers the parameters (ds_id).
    paths = [p for p in dict.fromkeys(unit_paths) if p]
    for path in sorted(paths, key=lambda p: -p.count(".")) + [""]:
        unit = model.get_submodule(path)
        for module in unit.modules():
            allocator(module)
        # hpZ: DeepSpeed creates its secondary-partition group in the first Init that
        # has none and asserts if asked to create it again: later calls get the first's.
        deepspeed.zero.Init(module=unit, config_dict_or_path=config,
                            zero_param_parallel_group=_hpz_group(config))
        # A unit's full tensors can outlive its partitioning in reference cycles until the
        # collector runs (seen once on 4 ranks: one block's weight still alive when the
        # next unit allocated). Collect now, so at most one unit is ever full at once.
        gc.collect()
    allocator.record_on(model)


def _hpz_group(config: dict[str, Any]) -> Any:
    """The hpZ secondary-partition group DeepSpeed already made (``None``: none yet, or
    no hpZ). One per process: a second size is refused rather than silently ignored."""
    from deepspeed.utils import groups

    size = int(config.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))
    group = groups._get_zero_param_intra_parallel_group()
    if size <= 1 or group is None:
        return None
    existing = groups._get_zero_param_intra_parallel_group_world_size()
    if existing != size:
        raise ValueError(
            f"hpz_partition_size={size}, but DeepSpeed already made its hpZ groups of "
            f"{existing} ranks in this process (it keeps one): use {existing}")
    return group


def _parallel_dims(mesh: ParallelDims | None, plan_dims: ParallelDims | None) -> ParallelDims | None:
    """The parallel dims of a DeepSpeed run: ``mesh=`` or the Plan's, which must agree
    when both are given."""
    if mesh is not None and plan_dims is not None and mesh != plan_dims:
        raise ValueError(f"mesh={mesh} differs from the Plan's parallel dims {plan_dims}: "
                         "give them in one place")
    return mesh if mesh is not None else plan_dims
