"""Run under torchrun by the engine tests: train each named scenario for a few steps.

    python -m torch.distributed.run --nproc_per_node 2 engine_worker.py OUT NAME [NAME ...]

For each scenario (see `tests.engines.harness.SCENARIOS`) it builds the example GPT, wraps it
with `annot.auto_wrap`, builds the optimizer, trains on this rank's slice of each batch,
and records (rank 0 writes OUT with torch.save): the global loss per step, the full
parameters afterwards, the parameter and state_dict names after wrapping, whether the
tied weights are still one parameter, how many block MLP forwards ran during
backward (recomputation), the bytes activation offload copied to the host per step, and
the modules DeepSpeed treats as ZeRO-3 leaves.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor

import annot
from annot.runtime.activation_offload import activation_offloader
from tests.distributed import worker_main
from tests.engines.harness import SCENARIOS, batches, make_model, make_optimizer, rank_slice


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def fsdp_groups(model: torch.nn.Module) -> dict[str, dict]:
    """Per FSDP2 module or FSDP1 instance (path without FSDP1's levels): whether its
    parameters are offloaded to CPU and whether it reshards after forward (read from
    the engine's own state)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            out[path.replace("_fsdp_wrapped_module.", "")] = {
                "offload": module.cpu_offload.offload_params,
                "reshard": module.sharding_strategy == ShardingStrategy.FULL_SHARD,
            }
        elif isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            out[path] = {
                "offload": all(p.offload_to_cpu for p in group.fsdp_params),
                "reshard": group.post_forward_mesh_info is not None,
            }
    return out


def full_parameters(wrapped: torch.nn.Module, model: torch.nn.Module, engine: str) -> dict:
    """Every parameter, whole, by its bare name (a collective: all ranks call it)."""
    if isinstance(wrapped, FullyShardedDataParallel):
        gathered = FullyShardedDataParallel.summon_full_params(wrapped)
        named = wrapped
    elif engine == "deepspeed":
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
        named = model
    else:
        gathered, named = contextlib.nullcontext(), model
    with gathered:
        return {n: full(p) for n, p in named.named_parameters()}


def run(name: str) -> dict:
    options = dict(SCENARIOS[name])
    engine = options.pop("engine")
    model = make_model()
    bare_names = [n for n, _ in model.named_parameters()]
    bare_keys = list(model.state_dict())

    # One training surface for every engine (annot.Trainable).
    trainer = annot.auto_wrap(model, engine, optimizer=make_optimizer, **options)
    wrapped = trainer.module

    groups = fsdp_groups(wrapped)

    in_backward = False
    recomputed = 0

    def count(*_: object) -> None:
        nonlocal recomputed
        recomputed += in_backward

    for block in model.transformer.h:
        # A pre-hook: recomputation stops early once the last saved tensor is rebuilt,
        # so a forward hook on the MLP would not see the MLP finish.
        block.mlp.register_forward_pre_hook(count)

    rank = dist.get_rank()
    losses = []
    for idx, targets in batches():
        _, loss = wrapped(rank_slice(idx, rank), rank_slice(targets, rank))
        in_backward = True
        trainer.backward(loss)
        in_backward = False
        trainer.step()
        trainer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())

    offloader = activation_offloader(model)
    offloaded = offloader.packed_bytes if offloader is not None else 0
    leaves = []
    if engine == "deepspeed":
        from deepspeed.utils import z3_leaf_module

        leaves = [path for path, m in model.named_modules() if z3_leaf_module(m)]
    params = full_parameters(wrapped, model, engine)
    named = model if engine in ("ddp", "deepspeed") else wrapped
    return {
        "losses": losses,
        "params": params,
        "bare_names": bare_names,
        "names": [n for n, _ in named.named_parameters()],
        "bare_keys": bare_keys,
        "keys": list(named.state_dict()),
        "modules": [n for n, _ in named.named_modules()],
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "fsdp_groups": groups,
        "recomputed_per_step": recomputed / len(losses),
        "offloaded_bytes_per_step": offloaded / len(losses),
        "z3_leaves": leaves,
    }


def run_all(*names: str) -> dict[str, dict]:
    return {name: run(name) for name in names}


if __name__ == "__main__":
    worker_main(run_all)
