"""`annot.auto_wrap`: plan a model and apply the Plan to an engine in the right order."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from annot.errors import EngineNotAvailableError
from annot.checkpoint_io.loading import load_logged
from annot.policies import Action, Plan, Policy, Rule, make_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from annot.engines.deepspeed import LeafModules

__all__ = ["ENGINES", "auto_wrap", "resolve_engine", "resolve_plan"]

Engine = Literal["fsdp2", "ddp", "fsdp1", "deepspeed"]

# Every engine name a user may write, resolved here and nowhere else.
ENGINES: dict[str, str] = {
    "fsdp2": "fsdp2",
    "fully_shard": "fsdp2",
    "ddp": "ddp",
    "fsdp1": "fsdp1",
    "fsdp": "fsdp1",  # torch's FullyShardedDataParallel class, as Lightning names it
    "deepspeed": "deepspeed",
}
_SHARDING = {"fsdp2", "fsdp1", "deepspeed"}

_DEEPSPEED_PRECISION = {None: None, torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_engine(engine: str) -> str:
    """The canonical engine name for ``engine`` (case-insensitive), or `ValueError`."""
    key = engine.lower().replace("-", "_") if isinstance(engine, str) else engine
    if key not in ENGINES:
        raise ValueError(
            f"unknown engine {engine!r}: choose one of {', '.join(sorted(set(ENGINES.values())))}"
        )
    return ENGINES[key]


def _resolve_dtype(mixed_precision: Any) -> Any:
    """``None`` for full precision, a torch dtype for a name, anything else as given
    (an engine's own policy object)."""
    if isinstance(mixed_precision, str):
        if mixed_precision.lower() in ("fp32", "float32", "no"):
            return None
        if mixed_precision.lower() not in _DTYPES:
            raise ValueError(
                f"mixed_precision={mixed_precision!r}: use 'bf16', 'fp16', 'fp32', a torch "
                "dtype or the engine's own policy object"
            )
        return _DTYPES[mixed_precision.lower()]
    return mixed_precision


def _resolve_offload(offload: bool | str | None, engine: str) -> bool | str | None:
    """``None`` (the Plan decides), ``False``, ``True`` (to CPU) or ``"nvme"``."""
    if offload is None or isinstance(offload, bool):
        return offload
    if offload == "cpu":
        return True
    if offload == "nvme":
        if engine != "deepspeed":
            raise EngineNotAvailableError(
                f"offload='nvme' with engine {engine!r}: NVMe offload is DeepSpeed's "
                "(engine='deepspeed'); torch engines offload to CPU"
            )
        return offload
    raise ValueError(f"offload must be None, True, False, 'cpu' or 'nvme', got {offload!r}")


def _refuse_unused(engine: str, **options: Any) -> None:
    """An option the engine would ignore is an error, never silently dropped."""
    given = [name for name, value in options.items() if value is not None and value is not False]
    if given:
        raise ValueError(f"engine {engine!r} does not take {', '.join(given)}")


def resolve_plan(model: nn.Module, policy: Policy | Rule | Plan | None) -> Plan:
    """The Plan for ``model``: ``policy`` itself if it is one (checked against the model),
    else planned from it."""
    if not isinstance(policy, Plan):
        return make_plan(model, policy)
    for unit in policy.units:
        for path in unit.modules:
            try:
                model.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"the Plan names module {path!r}, which {type(model).__name__} does not "
                    "have: was the Plan made for another model?"
                ) from None
    return policy


def auto_wrap(
    model: nn.Module,
    engine: Engine | str = "fsdp2",
    policy: Policy | Rule | Plan | None = None,
    *,
    checkpoint: bool | None = None,
    offload: bool | str | None = None,
    offload_activations: bool | None = None,
    mixed_precision: Any = None,
    reshard_after_forward: bool = True,
    mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    config: dict[str, Any] | None = None,
    leaf_modules: LeafModules | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    load_from: str | os.PathLike[str] | None = None,
) -> Any:
    """Plan ``model``, apply the Plan to ``engine``, and return what to train.

    Steps, in this order, so that a caller cannot get it wrong:

    1. Resolve the engine name (``"fsdp2"``, ``"fsdp1"``, ``"ddp"``, ``"deepspeed"``) and
       check the process group is initialized (`annot.ProcessGroupNotInitializedError`
       now, rather than a hang or a crash in the first collective).
    2. Check the model: a tensor on the meta device needs the record of `annot.meta_init`
       (else `annot.MetaDeviceError`), and for
       sharding engines no live optimizer on its parameters (`annot.OptimizerOrderError`):
       sharding replaces the parameters, so such an optimizer would silently train
       nothing. **Build the optimizer after this call** (DeepSpeed: pass ``optimizer=``,
       a factory it calls after partitioning).
    3. Build the Plan: ``policy`` may be a `Policy`, a rule (what it selects is sharded), a
       ready `Plan`, or ``None`` (the model's marks, else HuggingFace metadata).
    4. Checkpoint activations inside each unit, parameter names unchanged (torch's
       non-reentrant checkpoint; DeepSpeed's, after ``deepspeed.checkpointing.configure``,
       for DeepSpeed), because recomputation must run while the engine holds the unit's
       gathered parameters.
    5. Hand the model to the engine: FSDP2 shards each unit bottom-up (a tied group in one
       call), the root last; FSDP1 does the same through a wrap policy selecting the
       Plan's units (``use_orig_params=True``); DDP wraps the whole model; DeepSpeed runs
       ``deepspeed.initialize``.
    6. A model built under `annot.meta_init` is materialized: with FSDP2 after sharding,
       so each rank allocates only its shards plus about one parameter (values bitwise
       those of eager construction, on any number of ranks); with FSDP1 likewise after
       wrapping (FSDP1 allocates one unit's full tensors at a time while it shards, then
       the shards are filled); with DeepSpeed ZeRO-3 likewise, unit by unit before
       ``deepspeed.initialize`` (`annot.engines.deepspeed.partition_unit_by_unit`); with
       DDP and ZeRO-1/2, which keep whole parameters on every rank, before wrapping.
       With ``load_from`` (a safetensors checkpoint `annot.load` reads) the model is
       loaded at that same point instead: with FSDP2, FSDP1 and ZeRO-3 each rank reads
       only the rows its shards cover, with DDP and ZeRO-1/2 the whole model; the
       initialization of what the checkpoint provides is never run
       (`annot.from_pretrained` passes the model directory here). As transformers does, parameters the checkpoint lacks keep their initialization
       and keys the model lacks are ignored; both are logged as a warning (call
       `annot.checkpoint_io.loading.check_keys` first to refuse them).

    A transformers ``PreTrainedModel`` is adjusted first (`annot.huggingface.pretrained.
    prepare_for_training`, logged): its own gradient checkpointing is turned off when
    annot checkpoints, and ``config.use_cache`` is set to False when anything does.

    Options (an option the chosen engine cannot honour is an error, never ignored):
    ``checkpoint`` ``None`` follows the Plan, ``True`` checkpoints every unit, ``False``
    none. ``offload`` ``None`` offloads what the Plan marks (FSDP1: all or none),
    ``True``/``"cpu"`` everything, ``"nvme"`` (DeepSpeed only), ``False`` nothing: that
    is parameter offload (with optimizer state), except for DDP, which keeps parameters
    on the device and reads the Plan's offload marks as activation offload.
    ``offload_activations`` (DDP, FSDP2; `annot.runtime.activation_offload`) keeps what autograd
    saves in a unit's forward on the host until backward: ``True`` every unit, ``False``
    none, ``None`` the Plan's offload units for DDP and none for FSDP2.
    ``mixed_precision`` ``None`` (as the parameters are), ``"bf16"``/``"fp16"``/a dtype
    (compute in it, reduce gradients in fp32) or the FSDP engine's own policy object.
    ``reshard_after_forward`` ``True`` frees gathered parameters after each unit's forward
    (ZeRO-3; DeepSpeed stage 3), ``False`` keeps them for backward (ZeRO-2; stage 2).
    ``mesh`` (FSDP2) defaults to a 1-D mesh over all ranks; ``device`` to this rank's GPU
    (``LOCAL_RANK``) or the CPU. ``config`` (DeepSpeed) replaces the config
    `annot.deepspeed_config` would build; ``optimizer`` (DeepSpeed, required) builds the
    optimizer from the parameters. ``leaf_modules`` (DeepSpeed ZeRO-3) are classes, class
    names or a rule selecting modules (MoE blocks) that ZeRO-3 gathers whole on entry
    (``deepspeed.utils.set_z3_leaf_modules``) instead of hooking their submodules.

    Returns the model itself for FSDP2 (sharded in place), a ``DistributedDataParallel``
    for DDP and a ``DeepSpeedEngine`` for DeepSpeed (their ``.module`` is the model), all
    with the bare model's parameter names; for FSDP1 a ``FullyShardedDataParallel``,
    whose ``state_dict()`` keys are the bare model's while FSDP1 itself inserts
    ``_fsdp_wrapped_module.`` levels into module and parameter names. Checkpointing never
    adds a level (no ``_checkpoint_wrapped_module``).
    """
    from annot.engines import checks as _distributed
    from annot.runtime.activation_checkpoint import checkpointed_paths
    from annot.meta.deferred import deferred_init_of
    from annot.huggingface.pretrained import is_pretrained_model, prepare_for_training

    name = resolve_engine(engine)
    _distributed.require_process_group(name)
    deferred = deferred_init_of(model) is not None and _has_meta(model)
    if not deferred:
        _distributed.check_not_meta(model)
    if name in _SHARDING:
        _distributed.check_no_optimizer(model, name)
    plan = resolve_plan(model, policy)
    offload_to = _resolve_offload(offload, name)
    dtype = _resolve_dtype(mixed_precision)
    dev = _distributed.default_device(device)
    paths = checkpointed_paths(plan, checkpoint)
    if name == "deepspeed":
        paths = _without_shared_parameters(model, paths)
    if is_pretrained_model(model):
        prepare_for_training(model, checkpointing=bool(paths))
    if load_from is not None and not deferred:  # a model with storage: loaded in place now
        load_logged(model, load_from, dev)
        load_from = None
    if deferred and name == "ddp":  # DDP replicates: the whole model on every rank
        _fill(model, load_from, dev)
    offload_activation_paths = _activation_offload_paths(plan, name, offload_activations)
    if name != "deepspeed":
        _refuse_unused(name, config=config, optimizer=optimizer, leaf_modules=leaf_modules)
        _check_plan_offload(plan, name, offload_to)

    if name == "ddp":
        from annot.engines.ddp import apply_ddp

        # DDP replicates the whole model: use torch.autocast for mixed precision.
        _refuse_unused(name, offload=offload_to, mixed_precision=dtype, mesh=mesh)
        return apply_ddp(
            model, checkpoint_paths=paths, device=dev,
            offload_activation_paths=offload_activation_paths,
        )

    # What FSDP1 and FSDP2 both take.
    fsdp_options: dict[str, Any] = dict(
        checkpoint_paths=paths,
        offload=offload_to,
        mixed_precision=dtype,
        reshard_after_forward=reshard_after_forward,
        device=dev,
    )
    if name == "fsdp1":
        from annot.engines.fsdp1 import apply_fsdp1

        _refuse_unused(name, mesh=mesh)
        wrapped = apply_fsdp1(model, plan, **fsdp_options)
        if deferred:
            _fill(wrapped, load_from, dev)
        return wrapped

    if name == "deepspeed":
        from annot.engines.deepspeed import apply_deepspeed
        from annot.engines.deepspeed_config import deepspeed_config

        _refuse_unused(name, mesh=mesh)
        if optimizer is None:
            raise ValueError(
                "engine 'deepspeed' needs optimizer=: a function from parameters to an "
                "optimizer (e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)); "
                "DeepSpeed calls it after partitioning the model"
            )
        if config is None:
            config = deepspeed_config(
                plan,
                stage=3 if reshard_after_forward else 2,
                offload={None: None, False: "none", True: "cpu"}.get(offload_to, offload_to),
                precision=_deepspeed_precision(dtype),
            )
        elif offload is not None or dtype is not None:
            raise ValueError(
                "engine 'deepspeed' with config=: set offload and precision in the config "
                "(annot.deepspeed_config(..., offload=..., precision=...)), not here"
            )
        return apply_deepspeed(
            model, checkpoint_paths=paths, config=config, optimizer=optimizer,
            leaf_modules=leaf_modules, device=dev, load_from=load_from,
            unit_paths=[m for u in plan.units if u.has(Action.SHARD) for m in u.modules],
        )

    from annot.engines.fsdp2 import apply_fsdp2

    wrapped = apply_fsdp2(
        model, plan, mesh=mesh, offload_activation_paths=offload_activation_paths, **fsdp_options
    )
    if deferred:
        _fill(wrapped, load_from, dev)
    return wrapped


def _fill(model: nn.Module, load_from: str | os.PathLike[str] | None, device: torch.device) -> None:
    """Values for a `meta_init` model an engine has given storage (or not yet): loaded
    from ``load_from`` (what it lacks initialized), else initialized from the record."""
    from annot.meta.materialization import materialize

    if load_from is not None:
        load_logged(model, load_from, device)
    else:
        materialize(model, device=device)


def _without_shared_parameters(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` less the modules holding a parameter also used outside them (a tied
    embedding and head). DeepSpeed's checkpoint is reentrant: its recomputation runs a
    backward of its own, so such a parameter's gradient hook fires twice in one step and
    ZeRO-3 stops on a duplicate in its reduce bucket. Dropped paths are logged."""
    import logging

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


def _has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _deepspeed_precision(dtype: Any) -> str | None:
    if dtype not in _DEEPSPEED_PRECISION:
        raise ValueError(f"engine 'deepspeed' takes mixed_precision 'bf16', 'fp16' or None, not {dtype!r}")
    return _DEEPSPEED_PRECISION[dtype]


def _check_plan_offload(plan: Plan, engine: str, offload: bool | str | None) -> None:
    """Offload the Plan asks for (``offload=None``) that this torch engine cannot do."""
    if offload is not None:
        return
    wanted = [u.path for u in plan.units if u.offload_to == "nvme"]
    why = f"{engine} offloads to CPU only (NVMe offload is engine='deepspeed')"
    if wanted:
        raise EngineNotAvailableError(
            f"the Plan offloads {', '.join(wanted)}, but {why}: pass offload=False to train "
            "without it, or mark those modules offload='cpu'"
        )


def _activation_offload_paths(plan: Plan, engine: str, offload_activations: bool | None) -> list[str]:
    """Modules whose activations to offload. The Plan's offload marks mean activation
    offload only for DDP; FSDP2 reads them as parameter offload (``CPUOffloadPolicy``)."""
    from annot.runtime.activation_offload import offloaded_activation_paths

    if engine == "ddp":
        return offloaded_activation_paths(plan, offload_activations)
    if engine == "fsdp2":
        return offloaded_activation_paths(plan, bool(offload_activations))
    if offload_activations:
        raise EngineNotAvailableError(
            f"offload_activations with engine {engine!r} is not supported: use engine='fsdp2' "
            "or 'ddp'"
            + (", or DeepSpeed's own annot.deepspeed_config(..., cpu_checkpointing=True)"
               if engine == "deepspeed" else "")
        )
    return []
