"""Run under torchrun by the HuggingFace tests (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 hf_worker.py OUT
        --engine ENGINE ARCH [ARCH ...] [--pretrained DIR ...]
        [--engine ENGINE ARCH [ARCH ...] [--pretrained DIR ...]] ...

For each ``--engine`` group in turn, for each architecture (see
`tests.huggingface.hf_archs.ARCHS`): build the model from the shared seed, wrap it with
``annot.auto_wrap(model, ENGINE, checkpoint=True)``, train 3 steps on this rank's rows,
and record the global loss per step and how many module forwards ran during backward
(recomputation). For each ``--pretrained`` directory (named ``<arch>``):
``annot.from_pretrained(DIR, ENGINE)`` and the logits of a probe batch; with FSDP2 also
``mmap=True`` (which parameters are not mapped from the file), and for the first
directory 3 steps of training from each load (losses, every gradient, the final state,
the file's digest before and after). One architecture's failure is recorded (with its
traceback) and the others still run. Rank 0 writes OUT with torch.save:
``{ENGINE: {"train": ..., "pretrained": ..., "mapped": ..., "mapped_training": ...}}``.
"""

from __future__ import annotations

import hashlib
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main
from tests.huggingface.hf_archs import (
    ARCHS,
    batches,
    count_recomputation,
    make_optimizer,
    probe_inputs,
    rank_rows,
)
from tests.mapped_files import not_mapped


def train(name: str, engine: str) -> dict:
    arch = ARCHS[name]
    model = arch.build()
    recomputed = count_recomputation(model, arch.layer)
    trainer = annot.auto_wrap(model, engine, checkpoint=True, optimizer=make_optimizer)

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches(name):
        loss = trainer(**rank_rows(batch, rank)).loss
        recomputed(True)
        trainer.backward(loss)
        recomputed(False)
        trainer.step()
        trainer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "recomputed": recomputed(False),
            "use_cache": getattr(model.config, "use_cache", None)}


def pretrained(directory: Path, engine: str, mmap: bool = False) -> dict:
    name = directory.name
    options = {"optimizer": make_optimizer} if engine == "deepspeed" else {}
    wrapped = annot.from_pretrained(directory, engine, mmap=mmap, **options)
    wrapped.eval()
    model = wrapped.model if isinstance(wrapped, annot.Trainable) else wrapped
    # Before any forward: FSDP2 keeps the root's parameters gathered after a forward
    # that no backward follows.
    whole = [n for n, p in model.named_parameters()
             if not hasattr(p, "to_local") or p.to_local().numel() == p.numel()]
    with torch.no_grad():
        logits = wrapped(**probe_inputs(name)).logits
    out = {"logits": logits.detach().clone(), "whole": whole, "state": full_state(model, engine)}
    if mmap:
        out["not_mapped"] = not_mapped(model, directory)
    return out


def mapped_training(directory: Path) -> dict:
    """3 SGD steps of the FSDP2 model loaded by reading and by mapping: losses, every
    gradient (whole), the final state, and the digest of the files before and after."""
    def digests() -> list[str]:
        return [hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.glob("*.safetensors"))]

    before = digests()
    runs = {}
    for mmap in (False, True):
        model = annot.from_pretrained(directory, "fsdp2", mmap=mmap)
        optimizer = make_optimizer(model.parameters())
        losses, grads = [], []
        for batch in batches(directory.name):
            loss = model(**rank_rows(batch, dist.get_rank())).loss
            loss.backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
        runs[mmap] = {"losses": losses, "grads": grads, "state": full_state(model, "fsdp2")}
    return {"read": runs[False], "mapped": runs[True], "digests": (before, digests())}


def full_state(model: torch.nn.Module, engine: str) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (a collective: every rank calls it)."""
    import contextlib

    gathered = contextlib.nullcontext()
    if engine == "deepspeed":
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gathered:
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                for n, t in model.state_dict().items()}


def guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception:  # recorded, so the test shows which architecture failed and why
        return {"error": traceback.format_exc()}


def run_engine(engine: str, *rest: str) -> dict:
    names = rest[:rest.index("--pretrained")] if "--pretrained" in rest else rest
    dirs = [Path(d) for d in rest[rest.index("--pretrained") + 1:]] if "--pretrained" in rest else []
    out = {"train": {n: guarded(train, n, engine) for n in names},
           "pretrained": {d.name: guarded(pretrained, d, engine) for d in dirs}}
    if engine == "fsdp2" and dirs:
        out["mapped"] = {d.name: guarded(pretrained, d, engine, True) for d in dirs}
        out["mapped_training"] = guarded(mapped_training, dirs[0])
    return out


def run(*argv: str) -> dict[str, dict]:
    starts = [i for i, arg in enumerate(argv) if arg == "--engine"]
    assert starts and starts[0] == 0, f"expected --engine ENGINE ..., got {argv}"
    groups = [argv[i + 1:j] for i, j in zip(starts, [*starts[1:], len(argv)], strict=True)]
    return {group[0]: run_engine(*group) for group in groups}


if __name__ == "__main__":
    worker_main(run)
