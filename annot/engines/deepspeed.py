"""DeepSpeed ZeRO driven by a Plan.

The order of steps:
1. ``deepspeed.checkpointing.configure`` with the config, without which DeepSpeed ignores
   the config's ``activation_checkpointing`` section (DESIGN.md lesson 9);
2. checkpoint the Plan's modules at run time with DeepSpeed's checkpoint, so partitioned
   and CPU activation checkpoints apply (module names unchanged, as with torch engines);
3. ``deepspeed.initialize``: ZeRO partitions what the stage says, then builds the
   optimizer from the parameters it now manages. The optimizer is a factory called by
   DeepSpeed, so it cannot be built on the parameters before partitioning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from annot.activation_checkpoint import apply_checkpointing

__all__ = ["apply_deepspeed", "deepspeed_checkpoint"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def deepspeed_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.checkpointing.checkpoint`` with the output's shape kept.

    DeepSpeed's checkpoint is reentrant (the gradient flows only if an input tensor
    requires grad, as a block's hidden state does) and returns a bare tensor where the
    function returned a 1-tuple (DESIGN.md lesson 9); the 1-tuple is restored here.
    """
    import deepspeed

    one_tuple = False

    def run(*a: Any, **k: Any) -> Any:
        nonlocal one_tuple
        out = function(*a, **k)
        one_tuple = isinstance(out, tuple) and len(out) == 1
        return out

    out = deepspeed.checkpointing.checkpoint(run, *args, **kwargs)
    return (out,) if one_tuple else out


def apply_deepspeed(
    model: nn.Module,
    *,
    checkpoint_paths: Sequence[str],
    config: dict[str, Any],
    optimizer: OptimizerFactory,
) -> Any:
    """Configure checkpointing, checkpoint ``checkpoint_paths``, and return the
    ``DeepSpeedEngine`` from ``deepspeed.initialize`` (its ``.module`` is ``model``)."""
    import deepspeed
    import torch.distributed as dist

    # DeepSpeed keeps its own communication backend; it wraps the process group torch
    # already has, and `configure` below needs it before `initialize` would set it up.
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    if checkpoint_paths:
        deepspeed.checkpointing.configure(None, deepspeed_config=config)
    apply_checkpointing(model, checkpoint_paths, deepspeed_checkpoint)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config
    )
    return engine
