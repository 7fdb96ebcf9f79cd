"""Activation memory, traced rather than guessed.

One forward runs under ``FakeTensorMode`` (shapes and dtypes only: no data, no real
memory, so a 70B config traces in seconds) with autograd's saved-tensor hooks counting
what backward will keep: every distinct storage saved for backward, parameters
excluded. Fake tensors stay on the CPU device so the same kernels (and so the same
saved tensors) are chosen as in a real CPU run; on a GPU, attention kernels may save
less (flash attention keeps no probability matrix).

Checkpointed units (the Plan's ``checkpoint`` action) are accounted from the same
trace: their interior is dropped and only their inputs are kept, and backward
recomputes one unit at a time, which adds that unit's interior as a transient peak.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from annot.policies import Action, Plan

__all__ = ["ActivationEstimate", "default_inputs", "trace_activations"]

OUTSIDE = ""  # attribution of tensors saved outside every checkpointed unit
InputsFn = Callable[[nn.Module, int, int], tuple[tuple[Any, ...], dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward at one (batch, seq).

    ``saved``: no checkpointing. ``saved_checkpointed``: with the Plan's checkpointing.
    ``recompute_peak``: the largest interior of one checkpointed unit, alive while backward
    recomputes it. ``per_unit``: interior bytes of each checkpointed unit.
    """

    batch: int
    seq: int
    saved: int
    saved_checkpointed: int
    recompute_peak: int
    per_unit: dict[str, int]

    @property
    def checkpointed_peak(self) -> int:
        return self.saved_checkpointed + self.recompute_peak


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def default_inputs(model: nn.Module, batch: int, seq: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids of shape (batch, seq) as the model's first input, and as its targets or
    labels when ``forward`` takes them (so the loss's saved tensors count too). Vision
    models (a ``pixel_values`` input) get images of the configured size instead."""
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)
    if "pixel_values" in params and config is not None:
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        return (), {"pixel_values": torch.zeros(batch, channels, size, size)}
    ids = torch.zeros(batch, seq, dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if "input_ids" in params:
        kwargs["input_ids"] = ids
        if "decoder_input_ids" in params:  # encoder-decoder: as long a target as the source
            kwargs["decoder_input_ids"] = ids
        if "labels" in params and not getattr(config, "is_encoder_decoder", False):
            kwargs["labels"] = ids
        return (), kwargs
    if "targets" in params:
        return (ids, ids), {}
    return (ids,), {}


def trace_activations(
    model: nn.Module,
    plan: Plan | None,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype | None = None,
    inputs: InputsFn | None = None,
) -> ActivationEstimate:
    """Trace one training-mode forward of ``model`` (any device, meta included; it is not
    modified) at
    ``batch`` x ``seq`` and count the bytes saved for backward, with and without the
    checkpointing in ``plan``. ``dtype`` casts floating parameters first (the compute
    dtype of mixed precision)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be at least 1, got batch={batch}, seq={seq}")
    checkpointed = set(plan.paths(Action.CHECKPOINT)) if plan is not None else set()
    modules = dict(model.named_modules())
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        # One entry per parameter: functional_call re-ties tied names itself.
        params = {name: _fake_like(t, dtype, is_param=True) for name, t in model.named_parameters()}
        buffers = {name: _fake_like(t, dtype, is_param=False) for name, t in model.named_buffers()}
        args, kwargs = (inputs or default_inputs)(model, batch, seq)
    state = {**params, **buffers}
    param_keys = {_storage_key(t) for t in params.values()}  # model states, not activations

    # Which checkpointed unit is running (innermost), and what each saved storage costs
    # and who saved it.
    active: list[str] = []
    sizes: dict[int, int] = {}
    savers: dict[int, set[str]] = {}
    unit_inputs: dict[str, set[int]] = {path: set() for path in checkpointed}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_keys:
            sizes[key] = t.untyped_storage().nbytes()
            savers.setdefault(key, set()).add(active[-1] if active else OUTSIDE)
        return t

    def enter(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            active.append(path)
            # Nested too: decoder layers take (cos, sin) tuples, caches, ...
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    key = _storage_key(value)
                    sizes.setdefault(key, value.untyped_storage().nbytes())
                    unit_inputs[path].add(key)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        active.pop()

    # Training mode (dropout masks are saved too); each module's own mode comes back after.
    modes = {m: m.training for m in modules.values()}
    model.train()
    handles = []
    for path in checkpointed:
        handles.append(modules[path].register_forward_pre_hook(enter(path), with_kwargs=True))
        handles.append(modules[path].register_forward_hook(leave))
    try:
        with fake_mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training

    saved = sum(sizes[k] for k in savers)
    per_unit = {
        path: sum(sizes[k] for k, who in savers.items() if path in who) for path in sorted(checkpointed)
    }
    # Kept with checkpointing: whatever something outside a checkpointed unit saved,
    # plus each checkpointed unit's inputs (held for the recomputation).
    kept = {k for k, who in savers.items() if OUTSIDE in who}
    for keys in unit_inputs.values():
        kept |= keys - param_keys
    return ActivationEstimate(
        batch=batch,
        seq=seq,
        saved=saved,
        saved_checkpointed=sum(sizes[k] for k in kept) if checkpointed else saved,
        recompute_peak=max(per_unit.values(), default=0),
        per_unit=per_unit,
    )


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None, *, is_param: bool) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s shape (``t`` may live on the meta device)."""
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(t.shape, t.stride(), dtype=target, device="cpu")
    if is_param and t.requires_grad and fake.is_floating_point():
        fake.requires_grad_(True)
    return fake
