"""Run by test_materialize_distributed.py under torchrun: build the example GPT under
meta_init, shard it with FSDP2 on a CPU mesh, materialize, and save the full parameters
(gathered) from rank 0 for the test to compare. Also records each rank's local bytes.

    torchrun ... fsdp2_materialize_worker.py OUT forward|reverse
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import annot
from examples.gpt.model import GPT
from tests.distributed import worker_main

SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)


def run(order: str) -> dict:
    reverse = order == "reverse"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(7)
    with annot.meta_init():
        model = GPT(**SHAPE)
    blocks = list(model.transformer.h)
    for block in reversed(blocks) if reverse else blocks:  # unit order must not matter
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    annot.materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    local = sum(p.to_local().numel() for p in model.parameters())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    locals_ = [None] * dist.get_world_size()
    dist.all_gather_object(locals_, local)
    return {"params": full, "buffers": buffers, "local_numel": locals_}


if __name__ == "__main__":
    worker_main(run)
