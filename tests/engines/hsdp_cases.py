"""Shared by the 4-rank HSDP test and its worker: the tiny transformers Llama, the
layouts, the data and the single-process reference.

Four ranks as 2 replicas x 2 shards (`annot.ParallelDims(replicate=2)`): FSDP2's HSDP,
FSDP1's ``HYBRID_SHARD``, and DeepSpeed ZeRO-3 with ZeRO++ hierarchical partitioning
over pairs of ranks (``hpz_partition_size=2``). Each rank trains on its own rows of
every step's batch; the reference trains the bare model on the union in one process,
so with equal rows the mean of the ranks' losses and the averaged gradients are the
reference's up to the order of float additions.
"""

from __future__ import annotations

import torch

from tests.huggingface.hf_archs import ARCHS, VOCAB

WORLD = 4
ROWS_PER_RANK = 2
SEQ = 8
STEPS = 3
SAVE_AFTER = 2  # steps before the training state is saved (and resumed from)
# fp32; what is left is the order of float additions in the reductions.
TOLERANCE = 1e-6

# scenario -> (engine, auto_wrap options other than the mesh)
ENGINES: dict[str, tuple[str, dict]] = {
    "fsdp2": ("fsdp2", {}),
    "fsdp1": ("fsdp1", {}),
    "zero3-hpz": ("deepspeed", {"stage": 3, "hpz_partition_size": 2}),
}


def llama() -> torch.nn.Module:
    """The tiny transformers Llama, eagerly from the matrix's seed, in training mode."""
    return ARCHS["llama"].build()


def batches() -> list[dict[str, torch.Tensor]]:
    """One batch per step, the union of all ranks' rows (rank r: rows r*R:(r+1)*R)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (WORLD * ROWS_PER_RANK, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def rank_rows(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for k, v in batch.items()}


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient at each step, and the parameters after the
    last, of the bare Llama trained in one process on the union of the ranks' rows."""
    model = llama()
    optimizer = make_optimizer(model.parameters())
    losses, grads = [], []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
