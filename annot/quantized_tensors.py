"""Recognising a quantized weight (torchao's ``NF4Tensor``, what ``quantize="nf4"``
makes) without importing torchao, and turning one back into a plain tensor.

The checkpoint writers, the training-state saver and the engines' checks meet
quantized weights but sit below `annot.quantization` (docs/design.md, layers): they ask
here. A quantized weight is a tensor subclass holding packed bytes and scales
(``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean``)
that reports the dtype it was quantized from; under FSDP2 it is the local part of a
``DTensor``. Recognised by what it holds, so a torchao that renames its class still
counts, and nothing here needs torchao installed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["QUANTIZED_PARTS", "dequantized", "is_quantized", "quantization_of"]

#: What an NF4 weight holds besides its shape: packed 4-bit codes, the first-level
#: scales quantized to 8 bits, their per-block factors and the whole tensor's mean scale.
QUANTIZED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part, any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def is_quantized(tensor: Any) -> bool:
    """Whether ``tensor`` (or a DTensor's local part) is a 4-bit NormalFloat weight."""
    local = _local(tensor) if isinstance(tensor, torch.Tensor) else None
    return local is not None and all(hasattr(local, part) for part in QUANTIZED_PARTS)


def quantization_of(tensor: torch.Tensor) -> dict[str, Any]:
    """The settings a quantized ``tensor`` was made with, as JSON data: the format, its
    block sizes and the dtype it dequantizes to (what a resumed run must match)."""
    local: Any = _local(tensor)
    return {"format": "nf4", "block_size": int(local.block_size),
            "scaler_block_size": int(local.scaler_block_size),
            "dtype": str(local.dtype).removeprefix("torch.")}


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its own dtype: a quantized weight dequantized (a DTensor's local rows
    each on their rank, so the result is sharded as ``tensor`` was), anything else as
    it is. Each rank dequantizes only its own rows: the scales travel with them."""
    if not is_quantized(tensor):
        return tensor
    local: Any = _local(tensor)
    with torch.no_grad():
        plain = local.get_original_weight().to(local.dtype)
    if local is tensor:
        return plain
    from torch.distributed.tensor import DTensor

    sharded: Any = tensor
    return DTensor.from_local(plain, sharded.device_mesh, sharded.placements,
                              shape=sharded.shape, stride=sharded.stride())
