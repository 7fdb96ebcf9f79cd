"""Run under torchrun by ``test_moe_load.py`` (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 moe_load_worker.py OUT RUN [RUN ...]

Each RUN is ``ENGINE:DIR``: DIR a tiny MoE checkpoint written by ``save_pretrained``,
named after its `tests.huggingface.moe_models.MOE_MODELS` entry; ENGINE ``fsdp2``,
``fsdp2-mmap`` (``mmap=True``), ``fsdp1`` or ``deepspeed`` (ZeRO-3). For each:
``annot.from_pretrained(DIR, ENGINE)``, every parameter and buffer gathered whole, one
forward on this rank's rows (the global loss) and, for ``fsdp2``, the backward's every
gradient, whole; and the same from transformers' own single-process ``from_pretrained``
on the union of the ranks' rows. One run's failure is recorded with its traceback and
the others still run. Rank 0 writes OUT with torch.save: ``{RUN: {"state", "loss",
"grads", "plain_state", "plain_loss", "plain_grads", "sharded"}}``.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

import annot
from tests.distributed import worker_main
from tests.huggingface.hf_archs import make_optimizer
from tests.huggingface.hf_worker import full_state, guarded
from tests.huggingface.moe_models import batch, plain, rank_rows


def compare(directory: Path, engine: str) -> dict:
    options: dict = {"mmap": True} if engine == "fsdp2-mmap" else {}
    if engine == "deepspeed":
        options["optimizer"] = make_optimizer
    wrapped = annot.from_pretrained(directory, engine.removesuffix("-mmap"), **options)
    model = wrapped.model if isinstance(wrapped, annot.Trainable) else wrapped
    wrapped.train()
    # Which fused expert weights FSDP2 split across the ranks (no rank holds them whole).
    sharded = [n for n, p in model.named_parameters()
               if ".experts." in n and hasattr(p, "to_local") and p.to_local().numel() < p.numel()]
    state = full_state(model, "deepspeed" if engine == "deepspeed" else "fsdp2")
    full = batch()
    loss = wrapped(**rank_rows(full, dist.get_rank())).loss
    grads = {}
    if engine == "fsdp2":
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    total = loss.detach().clone()
    dist.all_reduce(total)

    reference = plain(directory).train()
    plain_loss = reference(**full).loss
    plain_loss.backward()
    return {"state": state, "loss": total.item() / dist.get_world_size(), "grads": grads,
            "sharded": sharded,
            "plain_state": {n: t.detach().clone() for n, t in reference.state_dict().items()},
            "plain_loss": plain_loss.item(),
            "plain_grads": {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}}


def run(*runs: str) -> dict:
    return {spec: guarded(compare, Path(spec.partition(":")[2]), spec.partition(":")[0]) for spec in runs}


if __name__ == "__main__":
    worker_main(run)
