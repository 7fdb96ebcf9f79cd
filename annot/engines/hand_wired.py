"""torch's ``fully_shard`` called by hand, the way a user without annot writes FSDP2: the
reference `annot.verify` compares ``auto_wrap(..., "fsdp2")`` with (bitwise numbers,
step time). Here because only `annot.engines` imports ``torch.distributed.fsdp``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["fully_shard_by_hand"]


def fully_shard_by_hand(model: nn.Module, units: Iterable[nn.Module],
                        param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each of ``units`` (children first, as given), then ``model``, over
    the default process group; with ``param_dtype``, compute in it and reduce gradients
    in fp32 (what annot's ``mixed_precision="bf16"`` means). Returns ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if param_dtype is not None else None)
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
