"""Run under torchrun by ``test_moe.py`` (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 moe_worker.py OUT SCENARIO:MODEL ...

SCENARIO is ``fsdp2``, ``fsdp2-checkpoint``, ``fsdp2-clip`` (``Trainable.clip_grad_norm_``
to `CLIP_NORM` after each backward; the norm recorded), ``zero3``, ``zero3-checkpoint`` or
``zero3-noleaf`` (``leaf_modules=()``: no leaves, a control);
MODEL a key of `tests.huggingface.moe_training_models.MOE_MODELS`. Each pair: build the model from the
shared seed, ``annot.auto_wrap`` it, train `STEPS` SGD steps on this rank's rows, and
record per step the loss averaged over ranks and every gradient, whole. A pair's failure
is recorded with its traceback and the others still run. Rank 0 writes
``{pair: {"losses", "grads", "aux", "norms", "leaves"} or {"error"}}`` to OUT (``leaves``: the
ZeRO-3 leaf modules' paths; ``stacks``: rank 0's local shape of each FSDP2 expert stack).
"""

from __future__ import annotations

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
    trainer = annot.auto_wrap(build(name), engine, checkpoint=scenario.endswith("-checkpoint"),
                              optimizer=make_optimizer, **options)
    rank, world = dist.get_rank(), dist.get_world_size()
    # What this rank keeps of each expert stack (FSDP2: its rows, i.e. its experts).
    stacks = {n: tuple(p.to_local().shape) for n, p in trainer.model.named_parameters()
              if n.endswith("experts.gate_up_proj") and hasattr(p, "to_local")}
    losses, grads, aux, norms = [], [], [], []
    for ids in batches():
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
    return {"losses": losses, "grads": grads, "aux": aux, "norms": norms, "leaves": leaves,
            "stacks": stacks}


def run(*pairs: str) -> dict[str, dict]:
    results = {}
    for pair in pairs:
        scenario, _, name = pair.partition(":")
        try:
            results[pair] = train(scenario, name)
        except Exception:  # recorded, so the test names the pair that failed and why
            results[pair] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    worker_main(run)
