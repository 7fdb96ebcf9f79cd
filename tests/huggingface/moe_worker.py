"""Run under torchrun by ``test_moe.py`` (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 moe_worker.py OUT SCENARIO:MODEL ...

SCENARIO is ``fsdp2``, ``fsdp2-checkpoint``, ``fsdp2-clip`` (``Trainable.clip_grad_norm_``
to `CLIP_NORM` after each backward; the norm recorded), each also with ``-ep`` after
``fsdp2`` (``ParallelDims(ep=2)``: experts split over pairs of ranks, e.g. ``fsdp2-ep-clip``;
on 4 ranks each pair's experts are sharded over the two pairs, and ``fsdp2-ep-hsdp``
replicates them across the pairs instead: ``ParallelDims(replicate=2, ep=2)``), ``zero3``, ``zero3-checkpoint`` or
``zero3-noleaf`` (``leaf_modules=()``: no leaves, a control), or ``fsdp2-ep-resume``
(`resume`: a save and resume of expert-parallel training, not compared with one process);
MODEL a key of `tests.huggingface.moe_training_models.MOE_MODELS`. Each pair: build the model from the
shared seed, ``annot.auto_wrap`` it, train `STEPS` SGD steps on this rank's rows, and
record per step the loss averaged over ranks and every gradient, whole. A pair's failure
is recorded with its traceback and the others still run. Rank 0 writes
``{pair: {"losses", "grads", "aux", "norms", "leaves"} or {"error"}}`` to OUT (``leaves``: the
ZeRO-3 leaf modules' paths; ``stacks``: rank 0's local shape of each FSDP2 expert stack).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main
from tests.huggingface.moe_training_models import (
    CLIP_NORM,
    batches,
    build,
    make_optimizer,
    rank_rows,
)

#: Where ``fsdp2-ep-resume`` saves its state (a folder per model): the launching test's
#: temporary folder, passed in the environment.
RESUME_DIR = os.environ.get("ANNOT_TEST_RESUME_DIR", "/tmp/annot-moe-resume")


def _whole_grads(trainer: annot.Trainable, engine: str) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (a collective: every rank calls it)."""
    out = {}
    for name, param in trainer.model.named_parameters():
        if engine == "deepspeed":
            from deepspeed.utils import safe_get_full_grad

            grad = safe_get_full_grad(param)
        else:
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        out[name] = grad.detach().clone()
    return out


def train(scenario: str, name: str) -> dict:
    engine = "deepspeed" if scenario.startswith("zero3") else "fsdp2"
    options: dict = {"stage": 3} if engine == "deepspeed" else {}
    if scenario.endswith("-noleaf"):  # the control: ZeRO-3 hooks inside the MoE blocks
        options["leaf_modules"] = ()
    if "-ep" in scenario:  # experts split over pairs of ranks: 2 of the 4 experts each
        options["mesh"] = annot.ParallelDims(replicate=2 if "-hsdp" in scenario else 1, ep=2)
    trainer = annot.auto_wrap(build(name), engine, checkpoint=scenario.endswith("-checkpoint"),
                              optimizer=make_optimizer, **options)
    rank, world = dist.get_rank(), dist.get_world_size()
    # What this rank keeps of each expert stack (FSDP2: its rows, i.e. its experts).
    stacks = {n: tuple(p.to_local().shape) for n, p in trainer.model.named_parameters()
              if n.endswith("experts.gate_up_proj") and hasattr(p, "to_local")}
    losses, grads, aux, norms = [], [], [], []
    for ids in batches(world):
        out = trainer(input_ids=rank_rows(ids, rank), labels=rank_rows(ids, rank))
        trainer.backward(out.loss)
        if scenario.endswith("-clip"):
            norm = trainer.clip_grad_norm_(CLIP_NORM)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        grads.append(_whole_grads(trainer, engine))
        trainer.step()
        trainer.zero_grad()
        total = out.loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        aux.append(None if getattr(out, "aux_loss", None) is None else out.aux_loss.item())
    leaves = []
    if engine == "deepspeed":
        from deepspeed.utils import get_z3_leaf_modules

        chosen = {id(m) for m in get_z3_leaf_modules(trainer.model)}
        leaves = [path for path, m in trainer.model.named_modules() if id(m) in chosen]
    # Expert parallelism: each experts module's local expert count and its stacks' mesh.
    experts = {n: (m.num_experts, m.gate_up_proj.device_mesh.mesh_dim_names)
               for n, m in trainer.model.named_modules()
               if n.endswith(".experts") and hasattr(getattr(m, "gate_up_proj", None), "device_mesh")}
    return {"losses": losses, "grads": grads, "aux": aux, "norms": norms, "leaves": leaves,
            "stacks": stacks, "experts": experts}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _ep_trainer(name: str, ep: int) -> annot.Trainable:
    return annot.auto_wrap(build(name), "fsdp2", optimizer=_adamw, mesh=annot.ParallelDims(ep=ep))


def _step(trainer: annot.Trainable, ids: torch.Tensor) -> float:
    rank = dist.get_rank()
    out = trainer(input_ids=rank_rows(ids, rank), labels=rank_rows(ids, rank))
    trainer.backward(out.loss)
    trainer.step()
    trainer.zero_grad()
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _whole_params(trainer: annot.Trainable) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()}


def resume(name: str, directory: str) -> dict:
    """``fsdp2-ep-resume``: AdamW with experts split over both ranks, 2 steps
    uninterrupted; then 1 step, `annot.save_state`, and a fresh model (the initial
    weights again) resumed by `annot.load_state` with experts split (ep=2) and without
    (ep=1) for the second step. Losses and final whole parameters of each."""
    ids = batches()
    uninterrupted = _ep_trainer(name, 2)
    out: dict = {"uninterrupted": [_step(uninterrupted, x) for x in ids[:2]],
                 "uninterrupted_params": _whole_params(uninterrupted)}
    first = _ep_trainer(name, 2)
    loss0 = _step(first, ids[0])
    annot.save_state(directory, first, step=1)
    for ep in (2, 1):
        resumed = _ep_trainer(name, ep)
        annot.load_state(directory, resumed)
        out[f"resumed_ep{ep}"] = [loss0, _step(resumed, ids[1])]
        out[f"resumed_ep{ep}_params"] = _whole_params(resumed)
    return out


def run(*pairs: str) -> dict[str, dict]:
    results = {}
    for pair in pairs:
        scenario, _, name = pair.partition(":")
        try:
            if scenario == "fsdp2-ep-resume":
                results[pair] = resume(name, f"{RESUME_DIR}-{name}")
                continue
            results[pair] = train(scenario, name)
        except Exception:  # recorded, so the test names the pair that failed and why
            results[pair] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    worker_main(run)
