"""The user's own DeepSpeed config as the planner's input (issue #31, "the planner in the
user's terms").

`read_deepspeed_config` takes the dict (or JSON file) a run hands to
``deepspeed.initialize`` and returns the strategy it describes: the ZeRO stage, where
the optimizer state and the parameters live, the precision (``fp16``/``bf16``
sections) and the ``zero_optimization`` section with DeepSpeed's defaults filled in for
what the config leaves out. `annot.memory.engine_memory` reads the memory terms from
that section: ``reduce_bucket_size`` (twice with ``overlap_comm`` below stage 3),
``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters`` (a cap on prefetch),
``stage3_max_reuse_distance`` (parameters kept gathered until their next use),
``stage3_param_persistence_threshold`` (parameters kept whole). ``allgather_bucket_size``
is read and costs nothing: DeepSpeed 0.19's stage 1-2 all-gather writes into the flat
parameter buffer in place. Keys DeepSpeed knows that change no memory term are accepted
and ignored; a key DeepSpeed does not know, or a value of the wrong kind, is refused
naming the key. Imports nothing heavy (no DeepSpeed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from annot.memory.strategies import MemoryInputError, Strategy, strategy

__all__ = ["USER_DEEPSPEED_KEY", "UserDeepSpeed", "ddp_strategy", "read_deepspeed_config"]

USER_DEEPSPEED_KEY = "deepspeed-config"

#: DeepSpeed 0.19's defaults for the ``zero_optimization`` keys the memory model reads
#: (``deepspeed/runtime/zero/config.py``); ``overlap_comm`` defaults to on for stage 3
#: only (``DeepSpeedZeroConfig.overlap_comm_valid``).
ZERO_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "sub_group_size": 1_000_000_000,
}
_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
            "param_persistence_threshold": "stage3_param_persistence_threshold",
            "max_live_parameters": "stage3_max_live_parameters",
            "max_reuse_distance": "stage3_max_reuse_distance"}
_FLAGS = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
          "cpu_offload", "cpu_offload_param", "cpu_offload_params", "cpu_offload_use_pin_memory")
#: ``zero_optimization`` keys DeepSpeed 0.19 knows that change no term of the model
#: (communication, checkpoint saving, debugging); accepted and ignored.
_IGNORED = frozenset({
    "use_multi_rank_bucket_allreduce", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "zenflow", "stage3_model_persistence_threshold",
    "model_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold", "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential", "ignore_unused_parameters",
    "legacy_stage1", "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
    "leaf_module", "stage3_max_reuse_distance_in_numel", "mics_shard_size",
    "mics_hierarchical_params_gather",
})
_KNOWN = frozenset({"stage", "offload_optimizer", "offload_param", *ZERO_DEFAULTS, *_ALIASES,
                    *_FLAGS, *_IGNORED})
_DEVICES = ("none", "cpu", "nvme")


@dataclasses.dataclass(frozen=True)
class UserDeepSpeed:
    """What a user's DeepSpeed config says for memory: ``strategy`` (key
    `USER_DEEPSPEED_KEY`), ``precision`` (an `annot.memory.PRECISIONS` name) and
    ``zero`` (the ``zero_optimization`` section, canonical key names, every key the model
    reads present)."""

    strategy: Strategy
    precision: str
    zero: dict[str, Any]


def read_deepspeed_config(config: dict[str, Any] | str | os.PathLike[str]) -> UserDeepSpeed:
    """The `UserDeepSpeed` of ``config`` (a dict, or the path of a JSON file); see the
    module docstring. `MemoryInputError` names a bad key or value and the fix."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except OSError as exc:
            raise MemoryInputError(f"deepspeed config {path!r}: {exc.strerror or exc}; "
                                   "give the path of the JSON file you pass to DeepSpeed") from None
        except json.JSONDecodeError as exc:
            raise MemoryInputError(f"deepspeed config {path!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise MemoryInputError(f"a DeepSpeed config is a dict (or a JSON file of one), got "
                               f"{type(config).__name__}")
    raw = config.get("zero_optimization", {})
    if not isinstance(raw, dict):
        raise MemoryInputError("deepspeed config: 'zero_optimization' must be a dict, got "
                               f"{type(raw).__name__}")
    zero = _zero_section(raw)
    stage = zero["stage"]
    opt_device = _offload_device(zero, "offload_optimizer", legacy="cpu_offload")
    param_device = _offload_device(zero, "offload_param", legacy="cpu_offload_param")
    if param_device != "none" and stage != 3:
        raise MemoryInputError(f"deepspeed config: zero_optimization.offload_param needs stage 3, "
                               f"the config has stage {stage}")
    if opt_device != "none" and stage == 0:
        raise MemoryInputError("deepspeed config: zero_optimization.offload_optimizer needs "
                               "stage 1 or more")
    if param_device != "none" and opt_device == "none":
        raise MemoryInputError("deepspeed config: offload_param without offload_optimizer is not "
                               "modelled; offload the optimizer too (as DeepSpeed's ZeRO-Infinity does)")
    if param_device not in ("none", opt_device):
        raise MemoryInputError(f"deepspeed config: offload_param on {param_device!r} and "
                               f"offload_optimizer on {opt_device!r}: put both on one device")
    precision = _precision(config)
    options: dict[str, Any] = {"stage": stage}
    label = f"your DeepSpeed config (ZeRO-{stage}"
    if opt_device != "none":
        options["offload"] = opt_device
        options["offload_params"] = param_device != "none"
        label += f", {'params + ' if param_device != 'none' else ''}optimizer on {opt_device.upper() if opt_device == 'nvme' else 'CPU'}"
    label += ")"
    strategy = Strategy(USER_DEEPSPEED_KEY, label, "deepspeed", tuple(options.items()))
    return UserDeepSpeed(strategy=strategy, precision=precision, zero=zero)


def _zero_section(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` checked key by key, aliases resolved, DeepSpeed's defaults filled in."""
    zero: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _KNOWN:
            close = [k for k in sorted(_KNOWN) if k.split("_")[-1] == str(key).split("_")[-1]][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise MemoryInputError(f"deepspeed config: unknown key zero_optimization.{key}{hint}; "
                                   "DeepSpeed would refuse it too")
        if key in _IGNORED:
            continue
        name = _ALIASES.get(key, key)
        if name in ZERO_DEFAULTS or name == "stage":
            zero[name] = _count(key, value)
        elif name in _FLAGS:
            if not isinstance(value, bool):
                raise MemoryInputError(f"deepspeed config: zero_optimization.{key} must be true or "
                                       f"false, got {value!r}")
            zero[name] = value
        else:  # offload_optimizer / offload_param
            if value is not None and not isinstance(value, dict):
                raise MemoryInputError(f"deepspeed config: zero_optimization.{key} must be a dict "
                                       f"such as {{\"device\": \"cpu\"}}, got {value!r}")
            zero[name] = value or {}
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise MemoryInputError(f"deepspeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    zero.setdefault("overlap_comm", stage == 3)
    zero.setdefault("contiguous_gradients", True)
    for key, default in ZERO_DEFAULTS.items():
        zero.setdefault(key, default)
    if zero["reduce_bucket_size"] <= 0:
        raise MemoryInputError("deepspeed config: zero_optimization.reduce_bucket_size must be "
                               f"positive, got {zero['reduce_bucket_size']}")
    return zero


def _count(key: str, value: Any) -> int:
    """An element count as DeepSpeed takes it: an int, or a float such as 2e8."""
    if value == "auto":
        raise MemoryInputError(f"deepspeed config: zero_optimization.{key} is 'auto', which the "
                               "HuggingFace Trainer fills in; give the number it would use")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise MemoryInputError(f"deepspeed config: zero_optimization.{key} must be a whole "
                               f"non-negative number (e.g. 2e8), got {value!r}")
    return int(value)


def _offload_device(zero: dict[str, Any], key: str, *, legacy: str) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"`` for ``key``, or DeepSpeed's older boolean
    spelling (``cpu_offload``, ``cpu_offload_param(s)``: what Lightning 1.3 wrote)."""
    section = zero.get(key)
    if section is None:
        legacy_on = zero.get(legacy) or (legacy == "cpu_offload_param" and zero.get("cpu_offload_params"))
        return "cpu" if legacy_on else "none"
    device = section.get("device", "none")
    if device not in _DEVICES:
        raise MemoryInputError(f"deepspeed config: zero_optimization.{key}.device must be one of "
                               f"{', '.join(_DEVICES)}, got {device!r}")
    return str(device)


def _precision(config: dict[str, Any]) -> str:
    """``fp16-mixed`` / ``bf16-mixed`` from the enabled section, else ``fp32``."""
    enabled = []
    for section, name in (("fp16", "fp16-mixed"), ("bf16", "bf16-mixed"), ("bfloat16", "bf16-mixed")):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise MemoryInputError(f"deepspeed config: '{section}' must be a dict such as "
                                   f"{{\"enabled\": true}}, got {value!r}")
        flag = value.get("enabled", False)
        if flag == "auto":
            raise MemoryInputError(f"deepspeed config: {section}.enabled is 'auto', which the "
                                   "HuggingFace Trainer fills in; give true or false")
        if flag:
            enabled.append(name)
    if len(enabled) > 1:
        raise MemoryInputError("deepspeed config: fp16 and bf16 are both enabled; enable one")
    return enabled[0] if enabled else "fp32"


#: The DDP options that change memory, and their types (annot's ``DDPOptions`` names).
_DDP_MEMORY_OPTIONS = {"gradient_as_bucket_view": bool}


def ddp_strategy(options: dict[str, Any] | None) -> Strategy:
    """The planner's DDP row with the user's ``options`` (`_DDP_MEMORY_OPTIONS`); an
    unknown option or a value of the wrong type is refused, naming it."""
    base = strategy("ddp")
    for key, value in (options or {}).items():
        kind = _DDP_MEMORY_OPTIONS.get(key)
        if kind is None:
            raise MemoryInputError(f"ddp_options: {key!r} is not a DDP option the planner models; "
                                   f"known: {', '.join(_DDP_MEMORY_OPTIONS)}")
        if not isinstance(value, kind):
            raise MemoryInputError(f"ddp_options: {key} must be {kind.__name__}, got {value!r}")
    if not options:
        return base
    return dataclasses.replace(base, options=(*base.options, *sorted(options.items())))
