"""Run by test_materialize_distributed.py under torchrun: build the example GPT under
meta_init and let `auto_wrap` with an engine that shards flattened parameters (``fsdp1``,
or ``zero3``: DeepSpeed ZeRO-3) allocate it unit by unit and materialize it. Saves from
rank 0 the full parameters (gathered), buffers, each rank's local element count, the
allocation peak, and the losses of three training steps, for the test to compare.

    torchrun ... flat_materialize_worker.py OUT ENGINE [ENGINE ...]   (fsdp1, zero3)

Each engine in turn, in one launch; OUT holds one such record per engine."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import annot
from annot.meta.unit_allocation import unit_allocation_peak
from examples.gpt.model import GPT
from tests.distributed import worker_main
from tests.meta._training import LR, train

SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)
Update = Callable[[torch.Tensor], None]  # backward and optimizer step for a loss
# Each engine's setup: (what to call, gathered full parameters, local element count,
# allocation peak, update).


def fsdp1(model: nn.Module) -> tuple[nn.Module, dict, int, int | None, Update]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = annot.auto_wrap(model, "fsdp1")
    local = sum(p.numel() for p in model.parameters())  # 1-D views of this rank's shard
    with FullyShardedDataParallel.summon_full_params(wrapped):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)

    def update(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return wrapped, full, local, unit_allocation_peak(wrapped), update


def zero3(model: nn.Module) -> tuple[nn.Module, dict, int, int | None, Update]:
    import deepspeed

    trainer = annot.auto_wrap(model, "deepspeed", config=annot.deepspeed_config(model, stage=3),
                              optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    assert trainer.model is model
    local = sum(p.ds_tensor.numel() for p in model.parameters())
    full = {}
    for name, param in model.named_parameters():
        # One at a time: gathering a list at once returned wrong halves for some weights
        # with deepspeed 0.19.8 on CPU/gloo, while each partition held the right values.
        with deepspeed.zero.GatheredParameters([param]):
            full[name] = param.detach().clone()

    def update(loss: torch.Tensor) -> None:
        trainer.backward(loss)
        trainer.step()

    return trainer.module, full, local, unit_allocation_peak(model), update


def run_one(engine_name: str) -> dict:
    torch.manual_seed(7)
    with annot.meta_init():
        model = GPT(**SHAPE)
    wrapped, full, local, peak, update = {"fsdp1": fsdp1, "zero3": zero3}[engine_name](model)
    assert model.lm_head.weight is model.transformer.wte.weight

    def clean(name: str) -> str:
        return name.replace("_fsdp_wrapped_module.", "")

    full = {clean(n): t for n, t in full.items()}
    buffers = {clean(n): b.clone() for n, b in model.named_buffers()}
    losses = train(lambda idx: wrapped(idx, idx)[1], update, SHAPE["vocab_size"])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, peak))
    return {"params": full, "buffers": buffers, "local_numel": [g[0] for g in gathered],
            "alloc_peak": [g[1] for g in gathered], "losses": losses}


def run(*engines: str) -> dict[str, dict]:
    return {engine: run_one(engine) for engine in engines}


if __name__ == "__main__":
    worker_main(run)
