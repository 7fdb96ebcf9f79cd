"""`annot.deepspeed_config`: the DeepSpeed config dict for a model's Plan.

Everything that changes training is set explicitly, so DeepSpeed trains like plain
PyTorch unless asked otherwise (docs/design.md, pitfall 11): DeepSpeed 0.19 clips gradients at
1.0 when ``gradient_clipping`` is absent, and ZeRO refuses a plain torch optimizer
without ``zero_allow_untested_optimizer``. Building the dict imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from annot.errors import EngineNotAvailableError
from annot.host_memory import pin_host_memory
from annot.planning import resolve_plan
from annot.policies import Action, Plan

__all__ = ["PERSISTENCE_THRESHOLD", "deepspeed_config", "zero_buffer_sizes"]

_PRECISIONS = {None: None, "fp32": None, "bf16": "bf16", "fp16": "fp16"}
# Caps on the buffer sizes below, in elements: Lightning's reduce/all-gather bucket
# (2e8) and DeepSpeed's own defaults for the ZeRO-3 settings.
_BUCKET_CAP = 200_000_000
_PREFETCH_CAP = 50_000_000
_MAX_LIVE_CAP = 1_000_000_000
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default: parameters this small stay whole


def zero_buffer_sizes(plan: Plan, stage: int) -> dict[str, Any]:
    """The ``zero_optimization`` buffer settings annot writes, sized from the Plan's
    largest unit U (docs/design.md, pitfall 16).

    DeepSpeed's defaults are fixed element counts sized for tens-of-GiB GPUs: a 5e8-element
    reduce bucket (allocated whole with ``contiguous_gradients``: 1.9 GiB in fp32 however
    small the model) and ``stage3_max_live_parameters``/``stage3_max_reuse_distance`` of
    1e9, which keep every parameter of a model under ~5e8 gathered from forward to
    backward. Here: reduce and all-gather buckets of U (capped at Lightning's 2e8), ZeRO-3
    prefetch of one unit (capped at DeepSpeed's 5e7), at most two units live (the one
    running and the one prefetched, as FSDP2 does; capped at 1e9), a reuse distance of one
    unit, and DeepSpeed's persistence threshold (parameters of at most 1e5 elements,
    biases and norms, stay whole on every rank). ``overlap_comm`` is DeepSpeed's own
    default, written out: on for stage 3 only (it doubles stage 2's reduce buffer).
    """
    unit = max([u.params for u in plan.units] + [plan.root.params, 1])
    bucket = min(_BUCKET_CAP, unit)
    sizes: dict[str, Any] = {
        "contiguous_gradients": True,
        "overlap_comm": stage == 3,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if stage == 3:
        sizes.update({
            "stage3_prefetch_bucket_size": min(_PREFETCH_CAP, unit),
            "stage3_max_live_parameters": min(_MAX_LIVE_CAP, 2 * unit),
            "stage3_max_reuse_distance": min(_MAX_LIVE_CAP, unit),
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        })
    return sizes


def deepspeed_config(
    model_or_plan: nn.Module | Plan,
    *,
    stage: int = 2,
    offload: str | None = None,
    offload_params: bool | None = None,
    nvme_path: str | None = None,
    precision: str | None = None,
    micro_batch_size: int = 1,
    gradient_accumulation_steps: int = 1,
    gradient_clipping: float = 0.0,
    partition_activations: bool = False,
    cpu_checkpointing: bool = False,
    hpz_partition_size: int = 1,
    quantized_weights: bool = False,
    quantized_gradients: bool = False,
    for_: str | None = None,
) -> dict[str, Any]:
    """The config for ``deepspeed.initialize(model=..., optimizer=..., config=...)``.

    ``stage``: ZeRO stage 0-3. ``offload``: ``None`` (CPU if any Plan unit is marked
    offload, NVMe if one is marked ``"nvme"``), ``"none"``, ``"cpu"`` or ``"nvme"``
    (needs ``nvme_path``); stages 1-2 offload the optimizer state, stage 3 also the
    parameters unless ``offload_params=False`` (ZeRO-3 with the optimizer alone
    offloaded). Buffer sizes are written out (`zero_buffer_sizes`). With offload, a plain torch optimizer is allowed
    (``zero_force_ds_cpu_optimizer: false``). ``precision``: ``None``/``"fp32"``,
    ``"bf16"`` or ``"fp16"`` (dynamic loss scaling). ``gradient_clipping`` defaults to 0
    (off), unlike DeepSpeed. The ``activation_checkpointing`` section counts the Plan's
    checkpointed units; DeepSpeed reads it only once ``deepspeed.checkpointing.configure``
    has run with this config (docs/design.md, pitfall 9).

    ``for_``: the trainer that will own the run. ``"lightning"`` (``DeepSpeedStrategy(
    config=...)``) leaves out what Lightning sets from the Trainer (micro batch from the
    loader, ``accumulate_grad_batches``, ``gradient_clip_val`` (default 0), precision),
    and configures activation checkpointing from the section. ``"hf"`` (the HuggingFace
    Trainer's ``deepspeed=`` / Accelerate) writes those as ``"auto"``, filled from the
    ``TrainingArguments`` (``max_grad_norm`` included: HF's default clips at 1.0). A
    value given here for a key the trainer owns is refused, naming the trainer's
    setting. Either way apply the Plan's checkpointing to the model yourself
    (`annot.apply_checkpointing`), since neither trainer runs annot's engine.

    ZeRO++ (stage 3 only): ``hpz_partition_size=N`` is hierarchical partitioning (hpZ,
    ``zero_hpz_partition_size``): each rank also keeps a secondary copy of its parameters
    sharded over its group of N consecutive ranks (one node, with N the GPUs per node),
    so backward gathers them within that group instead of across the world; gradients
    and optimizer state stay partitioned over the world. ``quantized_weights`` /
    ``quantized_gradients`` (``zero_quantized_weights`` / ``zero_quantized_gradients``)
    communicate weights and gradients quantized; they need DeepSpeed's CUDA quantizer
    kernels, so they are refused without a GPU.
    """
    trainer_owned = _trainer_owned(for_, micro_batch_size=micro_batch_size,
                                   gradient_accumulation_steps=gradient_accumulation_steps,
                                   gradient_clipping=gradient_clipping, precision=precision)
    if isinstance(model_or_plan, Plan):
        plan = model_or_plan
    else:
        plan = resolve_plan(model_or_plan, None)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (ZeRO), got {stage!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be None, 'fp32', 'bf16' or 'fp16', got {precision!r}")
    target = _offload_target(plan, offload)
    if target == "nvme" and not nvme_path:
        raise ValueError("offload='nvme' needs nvme_path= (a directory on a fast local disk)")
    if cpu_checkpointing and stage == 3 and not torch.cuda.is_available():
        # Measured: DeepSpeed 0.19's CPU accelerator crashes in recomputation (a matmul on
        # an ungathered 0-d parameter) with ZeRO-3 and cpu_checkpointing
        # (docs/design.md, pitfall 12).
        raise EngineNotAvailableError(
            "cpu_checkpointing with ZeRO-3 crashes on DeepSpeed's CPU accelerator: use it on "
            "GPUs, or pass cpu_checkpointing=False (or stage=2) on CPU"
        )

    zero_plus = _zero_plus_plus(stage, hpz_partition_size, quantized_weights, quantized_gradients)
    if offload_params and (stage != 3 or target is None):
        raise ValueError("offload_params=True needs stage=3 and offload='cpu' or 'nvme'")
    zero: dict[str, Any] = {"stage": stage, **zero_buffer_sizes(plan, stage), **zero_plus}
    if target is not None:
        if stage == 0:
            raise ValueError("offload needs ZeRO stage 1 or more (stage 3 to offload parameters)")
        pin = _pin_offloaded_state(plan, with_params=stage == 3 and offload_params is not False)
        device: dict[str, Any] = {"device": target, "pin_memory": pin}
        if target == "nvme":
            device["nvme_path"] = nvme_path
        zero["offload_optimizer"] = dict(device)
        if stage == 3 and offload_params is not False:
            zero["offload_param"] = dict(device)

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": float(gradient_clipping),
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "activation_checkpointing": {
            "partition_activations": partition_activations,
            "cpu_checkpointing": cpu_checkpointing,
            "contiguous_memory_optimization": False,
            "number_checkpoints": len(plan.paths(Action.CHECKPOINT)),
        },
    }
    if target is not None:
        config["zero_force_ds_cpu_optimizer"] = False
    if _PRECISIONS[precision] == "bf16":
        config["bf16"] = {"enabled": True}
    elif _PRECISIONS[precision] == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    for key in trainer_owned:
        if for_ == "lightning":
            config.pop(key)
        else:
            config[key] = "auto"
    if for_ == "hf":  # precision from TrainingArguments(bf16=..., fp16=...)
        config["bf16"] = {"enabled": "auto"}
        config["fp16"] = {"enabled": "auto"}
    return config


# The keys each trainer sets itself -> the trainer's own setting, for messages.
_TRAINER_KEYS = {
    "lightning": {"train_micro_batch_size_per_gpu": "the train loader's batch size",
                  "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
                  "gradient_clipping": "Trainer(gradient_clip_val=...)"},
    "hf": {"train_micro_batch_size_per_gpu": "TrainingArguments(per_device_train_batch_size=...)",
           "train_batch_size": "the TrainingArguments' batch sizes",
           "gradient_accumulation_steps": "TrainingArguments(gradient_accumulation_steps=...)",
           "gradient_clipping": "TrainingArguments(max_grad_norm=...)"},
}
_PRECISION_OWNER = {"lightning": "Trainer(precision=...)", "hf": "TrainingArguments(bf16/fp16=...)"}


def _trainer_owned(for_: str | None, *, micro_batch_size: int, gradient_accumulation_steps: int,
                   gradient_clipping: float, precision: str | None) -> list[str]:
    """The keys the trainer ``for_`` owns; refuses a non-default value given for one."""
    if for_ is None:
        return []
    if for_ not in _TRAINER_KEYS:
        raise ValueError(f"for_ must be None, 'lightning' or 'hf', got {for_!r}")
    owned = _TRAINER_KEYS[for_]
    given = {"train_micro_batch_size_per_gpu": micro_batch_size != 1,
             "gradient_accumulation_steps": gradient_accumulation_steps != 1,
             "gradient_clipping": gradient_clipping != 0.0}
    wrong = [owned[key] for key, set_here in given.items() if set_here]
    if precision not in (None, "fp32"):
        wrong.append(_PRECISION_OWNER[for_])
    if wrong:
        raise ValueError(
            f"deepspeed_config(for_={for_!r}): the trainer sets these itself; give them there: "
            + ", ".join(wrong))
    return list(owned)


def _zero_plus_plus(stage: int, hpz_partition_size: int, quantized_weights: bool,
                    quantized_gradients: bool) -> dict[str, Any]:
    """The ZeRO++ keys asked for (none when none is), checked: they are ZeRO-3's, hpZ's
    group divides the world, the quantized collectives need CUDA kernels."""
    if isinstance(hpz_partition_size, bool) or not isinstance(hpz_partition_size, int) \
            or hpz_partition_size < 1:
        raise ValueError(f"hpz_partition_size must be a positive int (ranks per secondary "
                         f"partition group, e.g. the GPUs per node), got {hpz_partition_size!r}")
    asked = {"zero_hpz_partition_size": hpz_partition_size} if hpz_partition_size > 1 else {}
    if quantized_weights:
        asked["zero_quantized_weights"] = True
    if quantized_gradients:
        asked["zero_quantized_gradients"] = True
    if not asked:
        return {}
    names = ", ".join(k.removeprefix("zero_") for k in asked)
    if stage != 3:
        raise ValueError(f"{names} (ZeRO++) partition or quantize ZeRO-3's parameter "
                         f"collectives, but the stage is {stage}: use stage=3")
    if hpz_partition_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world % hpz_partition_size:
            raise ValueError(f"hpz_partition_size={hpz_partition_size} does not divide the "
                             f"{world} ranks: use a divisor of {world}, usually the GPUs per node")
    if (quantized_weights or quantized_gradients) and not torch.cuda.is_available():
        # DeepSpeed 0.19.8's CPU accelerator has no quantizer kernels (its QuantizerBuilder
        # is a NotImplementedBuilder): the run would fail inside DeepSpeed.
        raise EngineNotAvailableError(
            "ZeRO++ quantized_weights / quantized_gradients need DeepSpeed's CUDA quantizer "
            "kernels: use them on GPUs, or drop them on CPU (hpz_partition_size works on CPU)")
    return asked


def _pin_offloaded_state(plan: Plan, *, with_params: bool) -> bool:
    """Whether ZeRO-Offload's host state goes to pinned memory: on a GPU, and when this
    rank's partition fits its pinned budget (docs/design.md, pitfall 44). Per trained
    parameter DeepSpeed keeps on the host an fp32 master copy, Adam's two moments and an
    fp32 gradient (16 bytes), and with offloaded parameters the parameter itself."""
    counted = [(u.trainable, u.params, u.bytes) for u in plan.units]
    counted.append((plan.root.trainable, plan.root.params, plan.root.bytes))
    nbytes = 16 * sum(params if trainable is None else trainable for trainable, params, _ in counted)
    if with_params:
        nbytes += sum(sum(b.values()) for *_, b in counted)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return pin_host_memory(nbytes // world, "ZeRO-Offload's host state (fp32 master weights, "
                           "Adam moments and gradients)")


def _offload_target(plan: Plan, offload: str | None) -> str | None:
    if offload is None:
        targets = {u.offload_to for u in plan.units if u.has(Action.OFFLOAD)}
        return "nvme" if "nvme" in targets else ("cpu" if targets else None)
    if offload == "none":
        return None
    if offload not in ("cpu", "nvme"):
        raise ValueError(f"offload must be None, 'none', 'cpu' or 'nvme', got {offload!r}")
    return offload
