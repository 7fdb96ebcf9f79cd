"""DDP (``DistributedDataParallel``) driven by a Plan.

DDP replicates the whole model, so the Plan's shard units play no part; its
checkpointing and activation offload do (DDP cannot offload parameters, so a Plan's
offload mark means activation offload here: `annot.runtime.activation_offload`). The
order of steps: checkpoint the Plan's modules and hook activation offload around the
offloaded ones (`DDP.prepare`), give a `meta_init` model its values on this rank's
device (DDP broadcasts rank 0's values when it wraps, so they must exist first), then
move the model to the device and wrap (DDP registers its gradient hooks on the
parameters as they are at wrap time). Mixed precision is autocast in the wrapper's
forward (`AutocastDDP`); fp16 adds loss scaling in the `Trainable`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.amp import GradScaler
from torch.nn.parallel import DistributedDataParallel

from annot.engines.base import (
    INIT_SCALE,
    Engine,
    EngineState,
    Trainable,
    WrapRequest,
    checkpoint_and_offload_activations,
    is_fp16,
    refuse_nvme_marks,
    resolve_dtype,
)
from annot.engines.mesh import refuse_plan_dims
from annot.engines.training_state import TorchState
from annot.quantized_tensors import is_quantized

__all__ = ["DDP", "AutocastDDP", "DDPOptions", "apply_ddp"]

_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Options of ``engine="ddp"``.

    Args:
        offload_activations: keep what autograd saves in a unit's forward on the host
            until backward: ``None`` the units the Plan marks offload (DDP has no
            parameter offload, so that is what the mark means here), ``True`` every
            unit, ``False`` none.
        gradient_as_bucket_view: gradients are views into DDP's communication buckets
            (torch's memory saving: one gradient copy instead of two, 4 bytes per fp32
            parameter less; default ``True``). ``False`` keeps torch's default.
        mixed_precision: ``None`` (as the parameters are), ``"bf16"``/``"fp16"`` or the
            dtype: the forward runs under ``torch.autocast`` in it (parameters, gradients
            and their all-reduce stay in the parameters' dtype). fp16 gives the
            `Trainable` a ``GradScaler`` (loss scaling, skipped steps on inf/NaN).
    """

    offload_activations: bool | None = None
    gradient_as_bucket_view: bool = True
    mixed_precision: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        dtype = resolve_dtype(self.mixed_precision)
        if dtype is not None and dtype not in _AUTOCAST_DTYPES:
            raise ValueError(
                f"engine 'ddp' takes mixed_precision 'bf16', 'fp16', 'fp32' or None (autocast in "
                f"the forward), not {self.mixed_precision!r}")
        object.__setattr__(self, "mixed_precision", dtype)


class DDP(Engine[DDPOptions]):
    """torch DDP: the whole model replicated on every rank."""

    name = "ddp"
    Options = DDPOptions
    fills_before_wrap = True

    hints = {
        "offload": "DDP keeps every parameter on the device; offload_activations=True "
                   "offloads activations, engine='fsdp2' offloads parameters",
        "reshard_after_forward": "DDP does not shard; use engine='fsdp2'",
        "mesh": "DDP replicates over the default process group",
    }

    def check(self, model: nn.Module, request: WrapRequest, options: DDPOptions) -> None:
        plan = request.plan
        refuse_nvme_marks(plan, self.name)
        refuse_plan_dims(plan.parallel, self.name, "use engine='fsdp2' or 'fsdp1'")

    def prepare(self, model: nn.Module, request: WrapRequest, options: DDPOptions,
                checkpoint_paths: Sequence[str]) -> None:
        # DDP has no parameter offload: the Plan's offload marks mean activation offload.
        checkpoint_and_offload_activations(model, request.plan, checkpoint_paths,
                                           options.offload_activations)

    def wrap(self, model: nn.Module, request: WrapRequest, options: DDPOptions) -> nn.Module:
        return apply_ddp(model, device=request.device,
                         gradient_as_bucket_view=options.gradient_as_bucket_view,
                         autocast=options.mixed_precision)  # type: ignore[arg-type]  # a dtype now

    def loss_scaler(self, options: DDPOptions, device: torch.device) -> GradScaler | None:
        # DDP's gradients are all-reduced before the scaler reads them: every rank finds
        # the same inf/NaN, so torch's plain scaler agrees across ranks.
        return GradScaler(device.type, init_scale=INIT_SCALE) if is_fp16(options.mixed_precision) else None

    def state(self, trainable: Trainable) -> EngineState:
        """torch's distributed state-dict API, which gives the layout as it is."""
        return TorchState(trainable)


class AutocastDDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose forward runs under ``torch.autocast``, so the
    mixed precision is the wrapped module's own (with or without annot's `Trainable`)."""

    autocast_dtype: torch.dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return super().forward(*inputs, **kwargs)


def apply_ddp(model: nn.Module, *, device: torch.device,
              gradient_as_bucket_view: bool = True,
              autocast: torch.dtype | None = None) -> DistributedDataParallel:
    """Move ``model`` to ``device`` and wrap it in DDP; its ``.module`` is ``model`` with
    unchanged names. With ``gradient_as_bucket_view`` the gradients live in DDP's buckets
    (no second copy; annot.memory counts it so). ``autocast``: a dtype to run the forward
    in (``torch.autocast`` on ``device``); the parameters keep theirs. Quantized weights
    (a QLoRA base) are left out of DDP's broadcast at wrap, which re-quantizes torchao's
    NF4 (the codes stay, the scales change: measured) on every rank, rank 0 included;
    each rank quantized the same bytes from the same checkpoint, so nothing needs
    syncing, and frozen weights have no gradient to reduce (docs/design.md, pitfall 67)."""
    model.to(device)
    quantized = [name for name, p in model.named_parameters() if is_quantized(p)]
    if quantized:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)
    device_ids = [device] if device.type == "cuda" else None
    if autocast is None:
        return DistributedDataParallel(model, device_ids=device_ids,
                                       gradient_as_bucket_view=gradient_as_bucket_view)
    wrapped = AutocastDDP(model, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view)
    wrapped.autocast_dtype = autocast
    return wrapped
