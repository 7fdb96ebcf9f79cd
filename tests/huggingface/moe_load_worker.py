"""Run under torchrun by ``test_moe_load.py`` (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 moe_load_worker.py OUT RUN [RUN ...]

Each RUN is ``ENGINE:DIR``: DIR a tiny MoE checkpoint written by ``save_pretrained``,
named after its `tests.huggingface.moe_models.MOE_MODELS` entry; ENGINE ``fsdp2``,
``fsdp2-mmap`` (``mmap=True``), ``fsdp2-ep`` (``mesh=ParallelDims(ep=2)``), ``fsdp1`` or
``deepspeed`` (ZeRO-3); ``fsdp2-ep`` also records ``saved_state``: what transformers loads
from `annot.save`'s output. For each:
``annot.from_pretrained(DIR, ENGINE)``, every parameter and buffer gathered whole, one
forward on this rank's rows (the global loss) and, for ``fsdp2``, the backward's every
gradient, whole; and the same from transformers' own single-process ``from_pretrained``
on the union of the ranks' rows. One run's failure is recorded with its traceback and
the others still run. Rank 0 writes OUT with torch.save: ``{RUN: {"state", "loss",
"grads", "plain_state", "plain_loss", "plain_grads", "sharded"}}``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
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
    if engine == "fsdp2-ep":  # experts split over both ranks
        options["mesh"] = annot.ParallelDims(ep=2)
    wrapped = annot.from_pretrained(directory, engine.removesuffix("-mmap").removesuffix("-ep"), **options)
    model = wrapped.model if isinstance(wrapped, annot.Trainable) else wrapped
    wrapped.train()
    # Which fused expert weights FSDP2 split across the ranks (no rank holds them whole).
    sharded = [n for n, p in model.named_parameters()
               if ".experts." in n and hasattr(p, "to_local") and p.to_local().numel() < p.numel()]
    state = full_state(model, "deepspeed" if engine == "deepspeed" else "fsdp2")
    full = batch()
    loss = wrapped(**rank_rows(full, dist.get_rank())).loss
    grads = {}
    if engine in ("fsdp2", "fsdp2-ep"):
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    total = loss.detach().clone()
    dist.all_reduce(total)

    saved = _saved_state(wrapped) if engine == "fsdp2-ep" else None
    reference = plain(directory).train()
    plain_loss = reference(**full).loss
    plain_loss.backward()
    return {"state": state, "loss": total.item() / dist.get_world_size(), "grads": grads,
            "sharded": sharded, "local_experts": local_experts(model), "saved_state": saved,
            "plain_state": {n: t.detach().clone() for n, t in reference.state_dict().items()},
            "plain_loss": plain_loss.item(),
            "plain_grads": {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}}


def _saved_state(wrapped) -> dict[str, torch.Tensor]:
    """`annot.save` of the wrapped model (collective) into a fresh folder, loaded back by
    transformers' own single-process ``from_pretrained``: its state."""
    folder = [tempfile.mkdtemp(prefix="annot-ep-save-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    annot.save(wrapped, Path(folder[0]) / "saved")
    state = {n: t.detach().clone() for n, t in plain(Path(folder[0]) / "saved").state_dict().items()}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    return state


def local_experts(model) -> dict[str, int]:
    """Each experts module's ``num_experts`` (its local count under expert parallelism)."""
    return {n: m.num_experts for n, m in model.named_modules()
            if n.endswith(".experts") and isinstance(getattr(m, "num_experts", None), int)}


def run(*runs: str) -> dict:
    return {spec: guarded(compare, Path(spec.partition(":")[2]), spec.partition(":")[0]) for spec in runs}


if __name__ == "__main__":
    worker_main(run)
