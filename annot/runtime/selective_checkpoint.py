"""Selective activation checkpointing: a checkpoint that keeps some results of the
forward and recomputes only the rest in backward.

A Plan unit names its policy (`annot.policies.plan.Unit.checkpoint_policy`); the one
policy today is ``"save_matmuls"``: the outputs of matrix multiplications and fused
attention are kept, everything else in the unit (norms, activations, dropout masks,
element-wise arithmetic) is recomputed. The matmuls are the unit's FLOPs, the rest is
cheap to run again, so this keeps most of full checkpointing's saving at a small part
of its recomputation. The run time is torch's own
``create_selective_checkpoint_contexts`` inside its non-reentrant checkpoint, in eager
mode; recomputed results equal the first forward's bitwise (random operations replay
the saved generator state), so training is exact against no checkpointing.

`matmul_ops` is also what the memory planner reads to price the choice
(`annot.memory.choices`), so the cost model and the run time agree on what is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from annot.policies import Plan
from annot.policies.plan import CHECKPOINT_POLICIES
from annot.runtime.activation_checkpoint import CheckpointFn, checkpoint_module

__all__ = ["apply_plan_checkpointing", "matmul_ops", "selective_checkpoint"]


@functools.cache
def matmul_ops() -> frozenset[Any]:
    """The operator packets whose outputs ``"save_matmuls"`` keeps: matrix products and
    the fused attention kernels (each one's CPU and GPU variants)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


def _save_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if getattr(func, "_overloadpacket", func) in matmul_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_POLICIES: dict[str, Callable[..., CheckpointPolicy]] = {"save_matmuls": _save_matmuls}


def selective_checkpoint(policy: str) -> CheckpointFn:
    """A checkpoint function (as `annot.runtime.activation_checkpoint.checkpoint_module`
    takes) running torch's non-reentrant checkpoint with the selective ``policy``."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; choose from {', '.join(CHECKPOINT_POLICIES)}")
    rule = _POLICIES[policy]

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # A fresh pair of contexts per call: the cache of kept results belongs to one call.
        return checkpoint(function, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, rule),
                          **kwargs)

    run.__name__ = f"selective_checkpoint_{policy}"
    return run


def apply_plan_checkpointing(model: nn.Module, plan: Plan, paths: Iterable[str],
                             checkpoint_fn: CheckpointFn) -> list[str]:
    """Checkpoint the modules of ``model`` at ``paths``: those of a unit naming a
    selective policy with that policy, the others with ``checkpoint_fn`` (the engine's).
    Returns the paths, in order."""
    policies = {path: u.checkpoint_policy for u in plan.units for path in u.modules}
    done = []
    for path in paths:
        policy = policies.get(path)
        checkpoint_module(model.get_submodule(path),
                          selective_checkpoint(policy) if policy is not None else checkpoint_fn)
        done.append(path)
    return done
