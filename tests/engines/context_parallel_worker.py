"""Run under torchrun by test_context_parallel.py: FSDP2 or DeepSpeed with a ``cp`` dimension.

    python -m torch.distributed.run --nproc_per_node W context_parallel_worker.py OUT LAYOUT NAME...

For each NAME (``gpt``, ``llama``; ``NAME:ulysses`` with ``cp_attention="ulysses"``, else
the default all-gather): auto_wrap (the layout's engine, FSDP2 unless it names one) with
``ParallelDims(shard=S, cp=C)``
(`tests.engines.context_parallel_cases.LAYOUTS`), train STEPS steps on this group's
rows (the loop as without cp), record the loss every rank returns and every gradient
(whole) at every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import annot
from tests.distributed import gathered, worker_main
from tests.engines.context_parallel_cases import (
    LAYOUTS,
    batches,
    build,
    group_rows,
    loss_fn,
    make_optimizer,
)
from tests.engines.tensor_parallel_cases import tp_plan


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_grad(param: torch.nn.Parameter, engine: str) -> torch.Tensor:
    """The whole gradient: FSDP2's DTensor gathered, or DeepSpeed's partitions (between
    backward and step)."""
    if engine == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param).detach().clone()
    return full(param.grad)


def train(layout: str, case: str) -> dict:
    name, _, attention = case.partition(":")
    sizes = LAYOUTS[layout]
    engine = sizes.get("engine", "fsdp2")
    tp = sizes.get("tp", 1)
    dims = annot.ParallelDims(shard=sizes["shard"], cp=sizes["cp"], tp=tp)
    options: dict = {"stage": 3} if engine == "deepspeed" else {}
    if tp > 1:
        options["tp_plan"] = tp_plan(name)
    trainer = annot.auto_wrap(build(name), engine, mesh=dims, optimizer=make_optimizer,
                              checkpoint=True, cp_attention=attention or "allgather", **options)
    group = dist.get_rank() // (sizes["cp"] * tp)  # the data-parallel group: its rows
    losses, grads = [], []
    for batch in batches(name, sizes["shard"]):
        loss = loss_fn(name)(trainer, group_rows(batch, group))
        trainer.backward(loss)
        grads.append({n: full_grad(p, engine) for n, p in trainer.model.named_parameters()})
        trainer.step()
        trainer.zero_grad()
        # every rank's loss, as returned: the cp ranks of a group must agree
        losses.append(gathered(loss.item()))
    return {"losses": losses, "grads": grads, "attention": trainer.context_parallel.function.__name__}


def run(layout: str, *names: str) -> dict:
    return {name: train(layout, name) for name in names}


if __name__ == "__main__":
    worker_main(run)
