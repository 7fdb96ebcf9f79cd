"""`annot.auto_wrap`: plan a model and apply the Plan to an engine in the right order.

The order is owned here and nowhere else; what each step means for one engine lives in
that engine's module (the contract: `annot.engines.base`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from annot._deprecation import moved_attribute
from annot.checkpoint_io.formats import CheckpointSource
from annot.checkpoint_io.loading import check_compatible, load_source
from annot.compiled_blocks import CompileOptions, compile_units
from annot.devices import choose_device
from annot.engines import checks
from annot.engines.base import OptimizerFactory, Trainable, WrapRequest
from annot.engines.registry import get_engine
from annot.float8 import apply_float8, default_all_gather, refuse_float8, scale_refresher
from annot.formats.choice import checkpoint_source
from annot.huggingface.modality_standin import stand_in_for_towers
from annot.huggingface.model import keep_output_capturing, prepare_for_training
from annot.meta.deferred import deferred_init_of
from annot.planning import resolve_plan
from annot.policies import Action, Plan, Policy, Rule
from annot.policies.speed import with_speed_actions

if TYPE_CHECKING:
    from annot.engines.base import DistributedDataParallel, FullyShardedDataParallel

__all__ = ["auto_wrap"]

PolicyLike = Policy | Rule | Plan | None
PathLike = str | os.PathLike[str] | CheckpointSource


@overload
def auto_wrap(model: nn.Module, engine: Literal["fsdp2", "fully_shard"] = ...,
              policy: PolicyLike = ..., *, checkpoint: bool | None = ..., optimizer: None = ...,
              load_from: PathLike | None = ..., mmap: bool = ...,
              device: torch.device | str | None = ..., float8: str | bool | None = ...,
              float8_all_gather: bool | None = ..., compile: bool | str | CompileOptions | None = ...,
              options: Any = ..., **engine_options: Any) -> nn.Module: ...
@overload
def auto_wrap(model: nn.Module, engine: Literal["ddp"], policy: PolicyLike = ..., *,
              checkpoint: bool | None = ..., optimizer: None = ...,
              load_from: PathLike | None = ..., mmap: bool = ...,
              device: torch.device | str | None = ..., float8: str | bool | None = ...,
              float8_all_gather: bool | None = ..., compile: bool | str | CompileOptions | None = ...,
              options: Any = ..., **engine_options: Any) -> DistributedDataParallel: ...
@overload
def auto_wrap(model: nn.Module, engine: Literal["fsdp1", "fsdp"], policy: PolicyLike = ..., *,
              checkpoint: bool | None = ..., optimizer: None = ...,
              load_from: PathLike | None = ..., mmap: bool = ...,
              device: torch.device | str | None = ..., float8: str | bool | None = ...,
              float8_all_gather: bool | None = ..., compile: bool | str | CompileOptions | None = ...,
              options: Any = ..., **engine_options: Any) -> FullyShardedDataParallel: ...
@overload
def auto_wrap(model: nn.Module, engine: str = ..., policy: PolicyLike = ..., *,
              checkpoint: bool | None = ..., optimizer: OptimizerFactory,
              load_from: PathLike | None = ..., mmap: bool = ...,
              device: torch.device | str | None = ..., float8: str | bool | None = ...,
              float8_all_gather: bool | None = ..., compile: bool | str | CompileOptions | None = ...,
              options: Any = ..., **engine_options: Any) -> Trainable: ...
@overload
def auto_wrap(model: nn.Module, engine: str = ..., policy: PolicyLike = ..., *,
              checkpoint: bool | None = ..., optimizer: OptimizerFactory | None = ...,
              load_from: PathLike | None = ..., mmap: bool = ...,
              device: torch.device | str | None = ..., float8: str | bool | None = ...,
              float8_all_gather: bool | None = ..., compile: bool | str | CompileOptions | None = ...,
              options: Any = ..., **engine_options: Any) -> nn.Module | Trainable: ...


def auto_wrap(
    model: nn.Module,
    engine: str = "fsdp2",
    policy: PolicyLike = None,
    *,
    checkpoint: bool | None = None,
    optimizer: OptimizerFactory | None = None,
    load_from: PathLike | None = None,
    mmap: bool = False,
    device: torch.device | str | None = None,
    float8: str | bool | None = None,
    float8_all_gather: bool | None = None,
    compile: bool | str | CompileOptions | None = None,
    options: Any = None,
    **engine_options: Any,
) -> nn.Module | Trainable:
    """Plan ``model``, apply the Plan to ``engine``, and return what to train.

    Args:
        model: the bare model: built on a device, or under `annot.meta_init` (then each
            rank allocates only what it keeps, with eager construction's values).
        engine: ``"fsdp2"``, ``"fsdp1"``, ``"ddp"`` or ``"deepspeed"``.
        policy: a `Policy`, a rule (what it selects is sharded), a ready `Plan`, or
            ``None`` (the model's marks, else HuggingFace ``_no_split_modules``).
        checkpoint: ``None`` checkpoints what the Plan says, ``True`` every unit,
            ``False`` none (run-time, non-reentrant, parameter names unchanged).
        optimizer: a factory from parameters to an optimizer (required by DeepSpeed).
            Given, the result is a `Trainable` with the same ``backward``/``step``/
            ``zero_grad`` for every engine, so the training loop does not branch.
        load_from: a checkpoint `annot.load` reads (each sharded rank reads only the rows
            it keeps; the initialization of what it provides never runs), in the format
            of the model's library (`annot.formats.choice.checkpoint_source`), or a
            `CheckpointSource` naming the format.
        mmap: map ``load_from``'s tensors instead of reading them (`annot.load`'s
            ``mmap``: CPU, FSDP2, DDP or no engine; the files must not change while the
            model lives).
        device: where this rank computes (`annot.choose_device`): default the CPU on a
            gloo process group, else this rank's GPU (``LOCAL_RANK % device_count``);
            ``"cuda"`` takes this rank's GPU whatever the backend. A CUDA device becomes
            the current device. With ``optimizer=``, the `Trainable` moves each call's
            tensors there.
        float8: a recipe (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``): the
            eligible linears of the Plan's float8 units, or where it has none of its
            repeated blocks, compute in float8 (`annot.float8`; needs torchao). ``None``:
            as the Plan says; ``False``: none.
        float8_all_gather: FSDP2 gathers the float8 weights in float8 (``None``: where it
            is correct, FSDP2 with the tensorwise recipe).
        compile: ``True``, a backend's name or `annot.CompileOptions`: the Plan's compile
            units, or where it has none its repeated blocks, run compiled forwards
            (`annot.compiled_blocks`), after wrapping. ``None``: as the Plan says with
            the default options; ``False``: none.
        options: the engine's options object (`annot.engines.fsdp2.FSDP2Options`,
            ``FSDP1Options``, ``DDPOptions``, ``DeepSpeedOptions``), or pass its fields as
            keywords (``reshard_after_forward=False``, ``offload=True``, ``stage=2``,
            ...). An option the engine cannot honour is an error naming the engine.

    Returns the model itself for FSDP2 (sharded in place), a ``DistributedDataParallel``
    for DDP, a ``FullyShardedDataParallel`` for FSDP1 (its ``state_dict()`` keys are the
    bare model's), or, with ``optimizer``, a `Trainable`.

    Build the optimizer after this call (or pass ``optimizer=``): sharding replaces the
    parameters, and an optimizer built before fails at its first step with
    `annot.OptimizerOrderError` rather than silently training nothing. A transformers
    model (bare, or inside a PEFT model or a module of yours) is adjusted first
    (`annot.huggingface.model.prepare_for_training`, logged).
    """
    steps = get_engine(engine)                                    # 1. engine, options, model
    opts = steps.options(options, **engine_options)
    deferred = _deferred(model)
    plan = resolve_plan(model, policy)                            # 2. the Plan
    if float8 is not None or compile is not None:
        plan = with_speed_actions(plan, model, float8=float8,
                                  compile=None if compile is None else compile is not False)
    source = checkpoint_source(model, load_from) if load_from is not None else None
    request = WrapRequest(plan, choose_device(device), deferred, source if deferred else None, mmap)
    # What the engine cannot do with this model is said before asking for a process group,
    # so it shows (and is tested) without torchrun.
    steps.check(model, request, opts)
    refuse_float8(plan, model, steps.name, all_gather=float8_all_gather)
    compiled = plan.paths(Action.COMPILE)
    compile_options = CompileOptions.of(compile if compile is not None else bool(compiled))
    refuse_compile(steps.name, compiled)
    if mmap:
        checks.refuse_mapping(steps.name, steps.maps_checkpoint, request.load_from, request.device)
    checks.require_process_group(steps.name)
    if steps.requires_optimizer and optimizer is None:
        raise ValueError(
            f"engine {steps.name!r} needs optimizer=: a function from parameters to an "
            "optimizer (e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)); DeepSpeed "
            "calls it after partitioning the model")
    needed = steps.optimizer_needed()
    if needed is not None and optimizer is None:
        raise ValueError(f"engine {steps.name!r}: {needed} (e.g. optimizer=lambda params: "
                         "torch.optim.AdamW(params, lr=3e-4))")
    if request.load_from is not None:  # shapes and dtypes from the headers, before any allocation
        check_compatible(model, request.load_from.path, format=request.load_from.format)
    checkpointed = steps.checkpoint_paths(model, plan, checkpoint)
    prepare_for_training(model, checkpointing=bool(checkpointed)) # 3. HF training settings
    if source is not None and not deferred:                       # a model with storage
        load_source(model, source, request.device)
    gathered_in_float8 = default_all_gather(plan, steps.name, float8_all_gather)
    apply_float8(model, plan, all_gather=gathered_in_float8)      # 4. float8 linears (same parameters)
    before = list(model.parameters())
    steps.prepare(model, request, opts, checkpointed)             # 5. tools inside the units
    if deferred and steps.fills_before_wrap:                      # 6. storage and values
        steps.fill(model, request)
    wrapped = steps.wrap(model, request, opts)
    keep_output_capturing(model)  # transformers' recorded outputs of re-classed modules
    # After the engine's hooks, which gather what the stand-in's tower call uses.
    stand_in_for_towers(model, ordered_gathers=steps.gathers_in_module_order())
    if deferred and not steps.fills_before_wrap:
        steps.fill(wrapped, request)
    checks.forbid_stale_optimizers(before, wrapped, model, steps.name)
    if compile_options is not None:                               # 7. compiled units, hooks outside
        compile_units(model, compiled, compile_options)
    refresh_scales = scale_refresher(model)  # FSDP2's float8 all-gather: after each step
    if optimizer is None:                                         # 8. the training surface
        if steps.loss_scaler(opts, request.device) is not None:
            # fp16 compute needs loss scaling (docs/design.md, pitfall 34); the module alone
            # has none, so say so rather than train on underflowing gradients.
            logging.getLogger("annot").warning(
                "%s computes in fp16, and the module auto_wrap returns without optimizer= does "
                "not scale the loss: pass optimizer= (the Trainable scales it), or scale it "
                "yourself (torch's ShardedGradScaler for FSDP, GradScaler for DDP)", steps.name)
        if refresh_scales is not None:
            logging.getLogger("annot").info(
                "float8 all-gather: call annot.refresh_float8_scales(model) after each "
                "optimizer.step() to compute every weight's scale in one all-reduce (else each "
                "gather computes its own; the values are the same)")
        return wrapped
    trainable = steps.trainable(wrapped, model, optimizer, opts, device=request.device)
    if refresh_scales is not None:
        trainable.after_step.append(refresh_scales)
    return trainable


def refuse_compile(engine: str, paths: list[str]) -> None:
    """Raise ``ValueError`` when ``engine`` cannot run compiled units: FSDP1 puts its own
    wrapper modules between a unit and its children, DeepSpeed its hooks inside them."""
    if paths and engine not in ("fsdp2", "fully_shard", "ddp"):
        raise ValueError(
            f"compile with engine={engine!r} is not built: compiled units run under FSDP2 or "
            "DDP, whose hooks stay outside each unit's compiled forward (FSDP1 and DeepSpeed "
            "hook and re-wrap inside the units); use engine='fsdp2'")


def _deferred(model: nn.Module) -> bool:
    """Whether ``model`` is a `meta_init` build still on the meta device; a meta tensor
    without that record is an error (`annot.MetaDeviceError`)."""
    if deferred_init_of(model) is not None and any(
            t.is_meta for t in (*model.parameters(), *model.buffers())):
        return True
    checks.check_not_meta(model)
    return False


def __getattr__(name: str) -> Any:
    """Names this module exported until 0.2.0, now defined where they belong, reached
    here with a `DeprecationWarning` until 0.3.0 (``resolve_plan``, also exported then,
    is still imported here and so still reached plainly)."""
    from annot.engines import registry

    if name in ("ENGINES", "resolve_engine"):
        return moved_attribute(__name__, registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
