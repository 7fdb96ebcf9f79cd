"""Checks shared by the engines: process group, device, mesh, misuse.

Every check here guards a mistake the engines themselves punish late (a hang, a crash
deep in a collective, an optimizer that silently updates nothing), so `auto_wrap` runs
them before touching the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from annot.errors import (
    CheckpointError,
    EngineNotAvailableError,
    MetaDeviceError,
    OptimizerOrderError,
    ProcessGroupNotInitializedError,
)
from annot.huggingface.model import computes_outside_forward

__all__ = [
    "forbid_stale_optimizers",
    "check_not_meta",
    "refuse_computing_outside_forward",
    "refuse_mapping",
    "require_process_group",
]


def require_process_group(engine: str) -> None:
    """Raise `ProcessGroupNotInitializedError` unless the default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupNotInitializedError(
            f"engine {engine!r} needs torch.distributed, but no process group is initialized. "
            "Launch with torchrun (e.g. `torchrun --nproc_per_node 2 train.py`) and call "
            "annot.init_distributed() (NCCL on this rank's GPU, gloo on CPU) or "
            "torch.distributed.init_process_group() before annot.auto_wrap()."
        )


def refuse_mapping(engine: str, maps_checkpoint: bool, load_from: object | None,
                   device: torch.device) -> None:
    """Raise `CheckpointError` when ``mmap=True`` cannot apply, before the model changes:
    there must be a checkpoint to map, weights on the CPU (a device gets a copy anyway),
    and an engine whose parameters may be tensors of the file's (not flattened ones)."""
    why = None
    if load_from is None:
        why = "there is no load_from to map (or the model already has values)"
    elif not maps_checkpoint:
        why = f"{engine} keeps flattened parameters of its own, which cannot point at the file"
    elif device.type != "cpu":
        why = f"the weights go to {device}, so they are copied anyway"
    if why is not None:
        raise CheckpointError(f"mmap=True: {why}. Load without mmap.")


def _first(names: list[str], most: int) -> str:
    """The first ``most`` of ``names`` for an error message, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_not_meta(model: nn.Module) -> None:
    """Raise `MetaDeviceError` listing the modules whose tensors have no storage yet."""
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        shown = _first(meta, 5)
        raise MetaDeviceError(
            f"{type(model).__name__} has tensors on the meta device ({shown}) and no record of "
            "how to initialize them: build it under `with annot.meta_init():` (then auto_wrap "
            "materializes it shard by shard), or on a real device, before annot.auto_wrap()."
        )


def forbid_stale_optimizers(before: list[nn.Parameter], wrapped: nn.Module, model: nn.Module,
                            engine: str) -> None:
    """Make an optimizer fail at its first ``step`` if it would train the wrong tensors.

    Two mistakes train silently wrong. An engine that replaces parameter objects (FSDP2:
    DTensor parameters) leaves an optimizer built before it stepping tensors the model no
    longer uses (docs/design.md, pitfall 6): ``before`` are the parameters as they were,
    and those ``wrapped`` no longer holds are remembered (weakly). And a parameter that
    joins ``wrapped`` after this call (LoRA adapters added to a sharded model) is
    synchronised by no engine (pitfall 19): ``wrapped``'s parameters now are remembered,
    and ``model`` (the bare model, for the names in the message).
    A global optimizer step hook raises `OptimizerOrderError` in either case. Costs one
    pass over the parameters here; per ``step`` a dictionary lookup, and a pass over the
    wrapped models' parameters the first time an optimizer steps (again only when its
    parameter count changes).
    """
    kept = {id(p) for p in wrapped.parameters()}
    for param in before:
        if id(param) not in kept:
            _REPLACED[id(param)] = (weakref.ref(param, _forget(id(param))), engine, type(wrapped).__name__)
    _WRAPPED.append((weakref.ref(model), frozenset(kept), engine))
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_refuse_stale)


# id(parameter) -> (weak reference, engine, model class) for parameters an engine replaced.
_REPLACED: dict[int, tuple[weakref.ref[nn.Parameter], str, str]] = {}
# optimizer -> parameter count when it was last checked.
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HOOK: Any = None
# Each wrapped bare model (weakly), the ids of its parameters when wrapped, its engine.
_WRAPPED: list[tuple[weakref.ref[nn.Module], frozenset[int], str]] = []


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
    _refuse_added_after_wrapping(optimizer)
    _CHECKED[optimizer] = count


def _refuse_added_after_wrapping(optimizer: torch.optim.Optimizer) -> None:
    """A parameter that joined a wrapped model after `auto_wrap` (LoRA adapters added to a
    sharded model) is one no engine synchronises: ranks would train different values,
    silently (docs/design.md, pitfall 19)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    _WRAPPED[:] = [entry for entry in _WRAPPED if entry[0]() is not None]
    for ref, known, engine in _WRAPPED:
        model = ref()
        if model is None:
            continue
        added = [name.replace("_fsdp_wrapped_module.", "")  # FSDP1's level, in no user name
                 for name, p in model.named_parameters() if id(p) in stepped and id(p) not in known]
        if added:
            shown = _first(added, 4)
            raise OptimizerOrderError(
                f"{shown} joined {type(model).__name__} after annot.auto_wrap(engine={engine!r}), "
                f"which does not synchronise them across ranks: each rank would train its own "
                "values. Add adapters before wrapping: annot.from_pretrained(..., "
                "peft_config=...), or peft.get_peft_model(model, ...) before annot.auto_wrap.")


def refuse_computing_outside_forward(model: nn.Module, engine: str) -> None:
    """Raise `EngineNotAvailableError` for a model whose layers compute with their
    parameters outside their forward (`annot.huggingface.model.COMPUTES_OUTSIDE_FORWARD`:
    Reformer's reversible layers), on an engine that gathers a unit's parameters in
    forward hooks: it would crash inside the engine, or train on sharded values."""
    found = computes_outside_forward(model)
    if found is not None:
        cls, why = found
        raise EngineNotAvailableError(
            f"{type(model).__name__} cannot be sharded by {engine}: {cls}: {why}. Train it with "
            "engine='ddp' (or DeepSpeed ZeRO-1/2), which keep whole parameters")


def refuse_scalar_parameters(model: nn.Module, engine: str) -> None:
    """Raise `EngineNotAvailableError` for a model holding a parameter without
    dimensions (Moonshine-Streaming's ``log_k``, VibeVoice's ``latent_scaling_factor``):
    FSDP2 shards along dim 0 and refuses such a parameter inside ``fully_shard``, after
    the model has changed; here it is named before anything changes, with the engines
    that take it (FSDP1 and ZeRO-3 flatten parameters, DDP keeps them whole)."""
    scalars = [name for name, param in model.named_parameters() if param.dim() == 0]
    if scalars:
        shown = _first(scalars, 4)
        raise EngineNotAvailableError(
            f"{type(model).__name__} cannot be sharded by {engine}: {shown} "
            f"{'has' if len(scalars) == 1 else 'have'} no dimension, and FSDP2 shards every "
            "parameter along its first. Train it with engine='fsdp1' or 'deepspeed' (they "
            "flatten parameters) or 'ddp', or make the parameter one-dimensional (shape (1,)).")


#: bitsandbytes' quantized parameter classes (4-bit and 8-bit).
_BITSANDBYTES_PARAMETERS = ("Params4bit", "Int8Params")


def refuse_bitsandbytes_parameters(model: nn.Module, engine: str) -> None:
    """Raise `EngineNotAvailableError` for a model holding bitsandbytes' quantized
    parameters (a transformers model loaded with ``BitsAndBytesConfig``) on FSDP2: FSDP2
    moves parameters through its own copies, which drop the ``quant_state`` that
    bitsandbytes keeps on the parameter and canonicalise bf16 NaN bit patterns that
    about 0.1% of packed NF4 bytes look like (bitsandbytes #1945): it trains, silently
    wrong. Checked by class name, so nothing imports bitsandbytes."""
    found = [name for name, param in model.named_parameters()
             if type(param).__name__ in _BITSANDBYTES_PARAMETERS
             and type(param).__module__.startswith("bitsandbytes")]
    if found:
        raise EngineNotAvailableError(
            f"{type(model).__name__} holds bitsandbytes quantized parameters ({_first(found, 3)}), "
            f"which {engine} does not shard correctly (it drops their quantization state and "
            "alters packed bytes: bitsandbytes #1945). Load the full-precision checkpoint with "
            "annot.from_pretrained(..., peft_config=..., quantize='nf4'): torchao's NF4, whose "
            "all-gather moves the packed bytes untouched.")
