"""Expert parallelism on FSDP2: ``ParallelDims(ep=N)``.

``ep`` spans no ranks of its own: it splits the data-parallel ranks (torchtitan borrows
it from dp_shard the same way; transformers' ``DistributedConfig(ep_size=)`` likewise).
Two meshes cover the same world:

- the dense mesh (``replicate``, ``shard``) that every other parameter is sharded over,
  as without experts;
- the expert mesh (``replicate``, ``efsdp``, ``ep``, ``tp``) with ``efsdp = shard / ep``:
  consecutive groups of ``ep`` ranks split each MoE layer's experts among them
  (`annot.huggingface.expert_parallel`: transformers' styles and token exchange), and
  the ranks holding the same experts (``efsdp``, and ``replicate`` for HSDP) shard those
  experts' stacks with their own ``fully_shard`` call. ``tp`` has one rank: expert
  parallelism beside tensor parallelism is refused for now.

Gradients. Every rank's loss is its own batch's; the engine trains the mean over the
``replicate x shard`` data-parallel ranks. A dense gradient is that mean (FSDP2
averages over the dense mesh). An expert's gradient on its rank already sums the
contributions of every rank of its ``ep`` group (the all-to-all's backward brings them
home), so the reduction over its copies must sum and divide by the data-parallel size,
not by the copies' count: ``set_gradient_divide_factor(dp)``. FSDP2 applies a factor
other than the group size with ``PREMUL_SUM``, which gloo refuses, so with more than one
copy per shard the reduction is forced to a sum and divided after
(``set_force_sum_reduction_for_comms``); with one (``efsdp == 1``) FSDP2 divides the
local copy itself, and a forced sum would divide twice. The step's gradients equal the
single-process model's (tests/huggingface/test_moe.py, within 1e-4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from annot.huggingface.expert_parallel import (
    ExpertParallelPlan,
    apply_expert_parallel,
    resolve_expert_plan,
)
from annot.policies.parallel import ParallelDims

__all__ = ["ExpertLayout", "check_expert_parallel", "shard_experts"]

#: The expert mesh's dimension names, outermost first.
EXPERT_DIMS = ("replicate", "efsdp", "ep", "tp")


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """What `check_expert_parallel` resolved: the plan, the expert mesh, and the
    data-parallel size each expert gradient is divided by."""

    plan: ExpertParallelPlan
    mesh: DeviceMesh
    data_parallel: int

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def copies_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts, which shard them: ``efsdp``, with
        ``replicate`` before it for HSDP."""
        if self.mesh["replicate"].size() > 1:
            return self.mesh["replicate", "efsdp"]
        return self.mesh["efsdp"]

    def apply(self, model: nn.Module) -> None:
        """Split the experts over ``ep`` and install the token exchange (before
        checkpointing and sharding)."""
        apply_expert_parallel(model, self.plan, self.ep_mesh, self.mesh["tp"])


def check_expert_parallel(model: nn.Module, dims: ParallelDims, world: int,
                          device_type: str, mp_policy: MixedPrecisionPolicy) -> ExpertLayout | None:
    """The `ExpertLayout` for ``dims`` on ``world`` ranks, or ``None`` when ``dims.ep`` is
    1. Refuses, before the model changes, what FSDP2 cannot do with experts split:
    ``ep`` beside tensor or context parallelism, an ``ep`` that does not divide the
    ``shard`` size, a model without an expert-parallel plan or whose expert counts
    ``ep`` does not divide, gradients ``mp_policy`` would divide twice. Builds the
    expert mesh (a collective: every rank calls it)."""
    if dims.ep == 1:
        return None
    dims = dims.resolve(world)
    if dims.tp != 1 or dims.cp != 1:
        raise ValueError(
            f"{dims.describe()}: expert parallelism beside tensor or context parallelism is not "
            "available in annot yet (transformers' DistributedConfig(tp_size=, ep_size=) has "
            "the former). Use tp=1 and cp=1 with ep, or ep=1")
    if dims.shard % dims.ep:
        raise ValueError(
            f"{dims.describe()}: ep={dims.ep} must divide shard={dims.shard}: each group of ep "
            "consecutive ranks splits the experts, and the groups shard their copies over "
            "the rest")
    plan = resolve_expert_plan(model, dims.ep)
    for path in plan.experts:  # one copy per expert's rows: FSDP2 divides in place
        _refuse_double_division(path, model.get_submodule(path), mp_policy,
                                sharded=dims.shard // dims.ep > 1)
    sizes = (dims.replicate, dims.shard // dims.ep, dims.ep, 1)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_DIMS)
    return ExpertLayout(plan=plan, mesh=mesh, data_parallel=dims.replicate * dims.shard)


def shard_experts(model: nn.Module, layout: ExpertLayout, *, reshard_after_forward: bool,
                  mp_policy: MixedPrecisionPolicy,
                  offload_policy: Callable[[str], OffloadPolicy]) -> None:
    """``fully_shard`` each experts module over the ranks holding its experts, with the
    gradient division the module docstring derives; ``offload_policy`` gives each experts
    module's (by path: the unit holding it decides). Runs before the Plan's units, so
    each unit's own call takes what the experts module does not hold."""
    copies = layout.copies_mesh
    sharded = layout.mesh["efsdp"].size() > 1  # more than one copy per shard of rows
    for path in layout.plan.experts:
        module = model.get_submodule(path)
        fully_shard(module, mesh=copies, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy, offload_policy=offload_policy(path))
        fsdp = cast(FSDPModule, module)  # fully_shard made it one
        fsdp.set_gradient_divide_factor(float(layout.data_parallel))
        if sharded:
            fsdp.set_force_sum_reduction_for_comms(True)


def _refuse_double_division(path: str, module: nn.Module, mp_policy: MixedPrecisionPolicy,
                            *, sharded: bool) -> None:
    """torch 2.13's FSDP2 divides an unsharded (one-copy) group's gradient by the factor
    and again by its pre/post factors when the reduction dtype risks overflow (fp16):
    refused rather than trained with gradients divided twice."""
    param = next(module.parameters(), None)
    reduce = mp_policy.reduce_dtype or mp_policy.param_dtype or (param.dtype if param is not None else None)
    if not sharded and reduce not in (None, torch.float32, torch.bfloat16):
        raise ValueError(
            f"expert parallelism: {path}'s gradients would be reduced in {reduce} with one copy "
            "per expert, which torch's FSDP2 divides twice. Reduce in fp32 "
            "(mixed_precision='fp16' does) or bf16")
