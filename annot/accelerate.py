"""What Accelerate and the HuggingFace Trainer take from a Plan.

Both wrap by **class name** (``transformer_cls_names_to_wrap`` /
``transformer_layer_cls_to_wrap``): every instance of a named class becomes an FSDP unit,
and activation checkpointing is on for all of them or none. `fsdp_plugin_kwargs` and
`hf_fsdp_config` write those settings from the Plan, and refuse a Plan they cannot express
(some instances of a class sharded and others not, every-Nth checkpointing, a tied group)
rather than hand over one that wraps something else (docs/design.md, pitfall 15). For such
Plans shard with `annot.auto_wrap` instead.

What the tools do not allow (Accelerate 1.15, transformers 5.23, read from their source and
measured on CPU): Accelerate turns its FSDP plugin on only for GPU-like devices; on CPU it
wraps every model in DDP, an annot-sharded FSDP2 model included, which then fails in
DDP's first broadcast. On GPUs its FSDP2 path returns a model that is already an
``FSDPModule`` unchanged. For DeepSpeed, pass ``annot.deepspeed_config(model, for_="hf")``
as ``TrainingArguments(deepspeed=...)`` and ``annot.apply_checkpointing(model,
engine="deepspeed")`` (measured on 2 CPU ranks).

fp16: the tool owns precision and loss scaling. Accelerate makes its loss scaler (a
``ShardedGradScaler`` under FSDP) only for ``Accelerator(mixed_precision="fp16")``, the HF
Trainer only for ``TrainingArguments(fp16=True)``; fp16 compute set anywhere else (an
FSDP ``mixed_precision_policy`` in fp16) trains unscaled, its small gradients
underflowing to zero (docs/design.md, pitfall 34). `fsdp_plugin_kwargs` warns when its
overrides ask for such a policy.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from annot.planning import resolve_plan
from annot.policies import Action, Plan, Policy, Rule
from annot.policies.model_index import qualified_class_name
from annot.runtime.units import unit_paths

__all__ = ["fsdp_plugin_kwargs", "hf_fsdp_config", "layer_class_names"]


def layer_class_names(model: nn.Module, policy: Policy | Rule | Plan | None = None, *,
                      checkpoint: bool | None = None) -> tuple[list[str], bool]:
    """``(class names to wrap, activation checkpointing on)`` for ``model``'s Plan, when
    class names say exactly what the Plan says; otherwise ``ValueError`` naming what
    they cannot express."""
    plan = resolve_plan(model, policy)
    shard = [u for u in plan.units if u.has(Action.SHARD)]
    grouped = [u.path for u in shard if u.group]
    if grouped:
        raise ValueError(f"units {', '.join(grouped)} group tied modules at different paths, "
                         "which class-name wrapping cannot express: use annot.auto_wrap")
    classes = list(dict.fromkeys(u.cls for u in shard))
    chosen = {u.path for u in shard}
    missed = [path for path, m in model.named_modules()
              if path and qualified_class_name(m) in classes and path not in chosen]
    if missed:
        raise ValueError(
            f"the Plan shards some instances of {', '.join(c.rsplit('.', 1)[-1] for c in classes)} "
            f"but not {', '.join(missed[:3])}: a class name wraps every instance. Use a policy "
            "by class (annot.by_class / no_split_modules), or annot.auto_wrap")
    checkpointed = set(unit_paths(plan, Action.CHECKPOINT, checkpoint))
    if checkpointed and checkpointed != chosen:
        raise ValueError(
            "the Plan checkpoints some units and not others; Accelerate and the HF Trainer "
            "checkpoint every wrapped layer or none: pass checkpoint=True or False, or "
            "checkpoint those modules with annot.apply_checkpointing(model, ...) and "
            "activation_checkpointing off")
    short = [c.rsplit(".", 1)[-1] for c in classes]
    if len(set(short)) != len(short):
        raise ValueError(f"classes {classes} share a name; Accelerate matches by name alone")
    return short, bool(checkpointed)


def fsdp_plugin_kwargs(model: nn.Module, policy: Policy | Rule | Plan | None = None, *,
                       checkpoint: bool | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.FullyShardedDataParallelPlugin`` (FSDP2) that
    wrap and checkpoint what ``model``'s Plan does; ``overrides`` are added as given (an
    fp16 ``mixed_precision_policy`` with a warning: the Accelerator's
    ``mixed_precision="fp16"`` must scale the loss)."""
    names, checkpointing = layer_class_names(model, policy, checkpoint=checkpoint)
    if _computes_in_fp16(overrides.get("mixed_precision_policy")):
        warnings.warn(
            "fsdp_plugin_kwargs: mixed_precision_policy computes in fp16, and Accelerate scales "
            "the loss only with Accelerator(mixed_precision='fp16'); without it small fp16 "
            "gradients underflow to zero, silently. Pass mixed_precision='fp16' to the "
            "Accelerator, or use bf16", UserWarning, stacklevel=2)
    return {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
            "transformer_cls_names_to_wrap": names, "activation_checkpointing": checkpointing,
            "reshard_after_forward": True, **overrides}


def hf_fsdp_config(model: nn.Module, policy: Policy | Rule | Plan | None = None, *,
                   checkpoint: bool | None = None) -> dict[str, Any]:
    """``TrainingArguments(fsdp="full_shard", fsdp_config=...)`` for ``model``'s Plan."""
    names, checkpointing = layer_class_names(model, policy, checkpoint=checkpoint)
    return {"version": 2, "transformer_layer_cls_to_wrap": names,
            "activation_checkpointing": checkpointing, "reshard_after_forward": True}


def _computes_in_fp16(policy: Any) -> bool:
    """Whether an Accelerate ``mixed_precision_policy`` (a name, a dtype, a dict or torch's
    ``MixedPrecisionPolicy``) casts parameters to fp16 for compute."""
    if isinstance(policy, dict):
        policy = policy.get("param_dtype")
    policy = getattr(policy, "param_dtype", policy)
    return policy in ("fp16", "float16", torch.float16)
