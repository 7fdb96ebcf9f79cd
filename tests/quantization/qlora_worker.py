"""2-rank worker: ``annot.from_pretrained(DIR, "fsdp2", peft_config=..., quantize="nf4")``
trained for `STEPS` steps of AdamW; rank 0 returns each step's mean loss and the
adapters' gradients (gathered whole).

Args: OUT DIR [checkpoint] [offload]."""

from __future__ import annotations

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main
from tests.quantization.cases import BATCHES, LR, SEED, adapter_grads, lora


def run(folder: str, *flags: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = annot.from_pretrained(folder, "fsdp2", peft_config=lora(), quantize="nf4",
                                  checkpoint="checkpoint" in flags, offload="offload" in flags)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    per_rank = BATCHES[0].shape[0] // world
    losses, grads = [], []
    for tokens in BATCHES:
        rows = tokens[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        grads.append(adapter_grads(model))
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    quantized = sum(type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" for p in model.parameters())
    return {"losses": losses, "grads": grads, "quantized": quantized}


if __name__ == "__main__":
    worker_main(run)
