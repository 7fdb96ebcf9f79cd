"""Worker of test_moe_lora.py: ``moe_lora_worker.py CHECKPOINT OUT`` on 2 CPU ranks.

Loads the fused-expert Qwen3-MoE at CHECKPOINT with LoRA on its experts through FSDP2
(`tests.finetune.test_moe_lora.lora_on_experts`), trains it on this rank's rows of the
shared batches, and has rank 0 save the mean losses and every trainable tensor, gathered
whole and under its one-process name (FSDP2 adds no wrapper), to OUT."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import annot
from tests.finetune.test_moe_lora import SEED, lora_on_experts, rows_of, train


def main(checkpoint: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)  # the adapters' random numbers, drawn alike everywhere
    model = annot.from_pretrained(checkpoint, "fsdp2", peft_config=lora_on_experts(), checkpoint=False)
    losses = train(model, rows_of(rank, world))
    mean = []
    for loss in losses:
        total = torch.tensor(loss)
        dist.all_reduce(total)
        mean.append(float(total) / world)
    trained = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
               for n, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"losses": mean, "trained": trained}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
