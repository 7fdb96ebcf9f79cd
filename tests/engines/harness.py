"""Shared by the engine tests and the worker they launch: the scenarios, the model, the
data, the optimizer and the single-process reference.

The worker (``engine_worker.py``, run by torchrun) and the reference (run in the pytest
process) build the model from the same seed and see the same batches: each rank gets
its slice of a step's batch, the reference the whole of it. With equal slices, the mean
of the ranks' losses is the loss on the union and the averaged gradients are its
gradients, so losses and parameters must agree up to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import WORLD_SIZE
from tests.reference import train_reference

WORKER = Path(__file__).with_name("engine_worker.py")

CONFIG = dict(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16)
BATCH_PER_RANK = 2
STEPS = 3
# fp32 everywhere; the only differences left are the order of float additions in the
# gradient reduction, far below this.
TOLERANCE = 1e-5

# name -> auto_wrap keyword arguments. checkpoint=None means "as the Plan says": the
# example GPT's blocks are marked @shard_block(checkpoint=True).
SCENARIOS: dict[str, dict] = {
    "fsdp2": dict(engine="fsdp2", checkpoint=False),
    "fsdp2-checkpoint": dict(engine="fsdp2", checkpoint=None),
    "fsdp2-offload-checkpoint": dict(engine="fsdp2", checkpoint=None, offload=True),
    "fsdp2-no-reshard": dict(engine="fsdp2", checkpoint=False, reshard_after_forward=False),
    "fsdp1": dict(engine="fsdp1", checkpoint=False),
    "fsdp1-checkpoint": dict(engine="fsdp1", checkpoint=None),
    "ddp": dict(engine="ddp", checkpoint=False),
    "ddp-checkpoint": dict(engine="ddp", checkpoint=None),
    # Activation offload (saved tensors copied to the host and back) on every block.
    "ddp-offload-activations": dict(engine="ddp", checkpoint=False, offload_activations=True),
    "fsdp2-offload-activations": dict(engine="fsdp2", checkpoint=False, offload_activations=True),
    # DeepSpeed: ZeRO-3 unless stage=2. A
    # checkpointed one first: DeepSpeed's checkpointing must be configured in a process
    # where no earlier deepspeed.initialize has set DeepSpeed's backend up.
    "zero3-checkpoint": dict(engine="deepspeed", checkpoint=None),
    "zero3": dict(engine="deepspeed", checkpoint=False),
    "zero2": dict(engine="deepspeed", checkpoint=False, stage=2),
    "zero2-checkpoint": dict(engine="deepspeed", checkpoint=None, stage=2),
    "zero3-offload-checkpoint": dict(engine="deepspeed", checkpoint=None, offload=True),
    # Every block's MLP a ZeRO-3 leaf (gathered whole on entry), by class name.
    "zero3-leaf-checkpoint": dict(engine="deepspeed", checkpoint=None, leaf_modules=["MLP"]),
}


def make_model() -> torch.nn.Module:
    from examples.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(**CONFIG)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (inputs, targets) pair per step, the union of all ranks' rows."""
    gen = torch.Generator().manual_seed(1)
    rows, length = WORLD_SIZE * BATCH_PER_RANK, CONFIG["block_size"]
    data = torch.randint(0, CONFIG["vocab_size"], (STEPS, rows, length + 1), generator=gen)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def rank_slice(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of the bare model trained in one process."""
    losses, model = train_reference(make_model, batches(), make_optimizer,
                                    lambda model, batch: model(*batch)[1])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
