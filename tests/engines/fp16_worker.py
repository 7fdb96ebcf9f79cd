"""Run under torchrun by tests/engines/test_fp16.py: fp16 compute with loss scaling on
each torch engine, against the fp32 update of the bare model.

    python -m torch.distributed.run --nproc_per_node 2 fp16_worker.py OUT DIR ENGINE [ENGINE ...]

The loss is multiplied by `SMALL` (2^-20), so its gradients lie below fp16's smallest
subnormal (2^-24) and underflow to zero without scaling. Per engine it records: the
update of one fp16 step with the scaler switched off (all zeros expected), the update of
`STEPS` scaled fp16 steps and of the same steps in fp32 on one process (the whole batch),
a step whose loss is inf on rank 1 (skipped: parameters and momentum unchanged, counted,
logged on rank 0), and the scaler's state before a `save_state` and after a
`load_state` into a fresh trainable (DIR holds the states).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

import annot
from tests.distributed import gathered, worker_main
from tests.engines.engine_worker import full_parameters
from tests.engines.harness import batches, make_model, rank_slice

SMALL = 2.0 ** -20
STEPS = 2


def make_optimizer(params) -> torch.optim.Optimizer:
    # SGD's update is linear in the gradient, so it shows the gradients' error as it is
    # (Adam's normalisation would hide a uniform scale error).
    return torch.optim.SGD(params, lr=1.0, momentum=0.9)


def reference_updates() -> tuple[dict[str, torch.Tensor], float]:
    """What `STEPS` fp32 steps on the whole batch change in each parameter (one process),
    and the gradient norm of the first step."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model.parameters())
    norms = []
    for idx, targets in batches()[:STEPS]:
        (model(idx, targets)[1] * SMALL).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, norms[0]


def fp16_trainable(engine: str) -> annot.Trainable:
    return annot.auto_wrap(make_model(), engine, checkpoint=False, optimizer=make_optimizer,
                           mixed_precision="fp16")


def train(trainer: annot.Trainable, steps: list, factor: float = SMALL) -> list[float]:
    """Train on ``steps``; returns each step's gradient norm from `clip_grad_norm_` with a
    bound no norm reaches (it unscales, so the norm is the loss's own)."""
    rank = dist.get_rank()
    norms = []
    for idx, targets in steps:
        _, loss = trainer(rank_slice(idx, rank), rank_slice(targets, rank))
        trainer.backward(loss * factor)
        norms.append(float(trainer.clip_grad_norm_(1e9)))
        trainer.step()
        trainer.zero_grad()
    return norms


def params(trainer: annot.Trainable, engine: str) -> dict[str, torch.Tensor]:
    return full_parameters(trainer.module, trainer.model, engine)


def momenta(trainer: annot.Trainable) -> list[torch.Tensor]:
    """This rank's momentum buffers (its shards), in the optimizer's order."""
    return [trainer.optimizer.state[p]["momentum_buffer"].detach().clone()
            for g in trainer.optimizer.param_groups for p in g["params"]
            if "momentum_buffer" in trainer.optimizer.state.get(p, {})]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run(directory: str, engine: str) -> dict:
    out: dict = {"scaler": None}
    rank = dist.get_rank()
    reference, reference_norm = reference_updates()

    # 1. fp16 without scaling: the gradients underflow.
    unscaled = fp16_trainable(engine)
    out["scaler"] = type(unscaled.scaler).__name__
    unscaled.scaler = None
    start = params(unscaled, engine)
    train(unscaled, batches()[:1])
    end = params(unscaled, engine)
    changed = sum(int((end[n] != start[n]).sum()) for n in start)
    out["unscaled_changed_fraction"] = changed / sum(t.numel() for t in start.values())

    # 2. fp16 with the trainable's scaler: the fp32 update, and the fp32 gradient norm
    #    from clip_grad_norm_ (the gradients unscaled first).
    trainer = fp16_trainable(engine)
    start = params(trainer, engine)
    norms = train(trainer, batches()[:STEPS])
    out["skipped_in_training"] = trainer.skipped_steps
    out["norm"] = (norms[0], reference_norm)
    end = params(trainer, engine)
    num = math.sqrt(sum(float(((end[n] - start[n]) - reference[n]).square().sum()) for n in start))
    den = math.sqrt(sum(float(reference[n].square().sum()) for n in start))
    out["relative_error"] = num / den
    out["worst_parameter"] = max(
        (float(((end[n] - start[n]) - reference[n]).norm() / reference[n].norm()), n)
        for n in start if reference[n].norm() > 0)

    # 3. A step whose loss is inf on rank 1 only: skipped on every rank.
    records = Records()
    logging.getLogger("annot").addHandler(records)
    scale, moments = trainer.scaler.get_scale(), momenta(trainer)
    before = params(trainer, engine)
    train(trainer, batches()[:1], factor=math.inf if rank == 1 else SMALL)
    after = params(trainer, engine)
    logging.getLogger("annot").removeHandler(records)
    out["skip"] = {
        "params_equal": gathered(all(torch.equal(before[n], after[n]) for n in before)),
        "momenta_equal": gathered(all(torch.equal(a, b) for a, b in zip(moments, momenta(trainer), strict=True))
                                  and len(moments) > 0),
        "skipped_steps": gathered(trainer.skipped_steps),
        "scale": (scale, trainer.scaler.get_scale()),
        "warnings": gathered(records.messages),
    }

    # 4. The scaler's state (after the backoff and a good step) through save/load.
    train(trainer, batches()[1:2])
    saved = trainer.scaler.state_dict()
    annot.save_state(directory, trainer, step=7)
    fresh = fp16_trainable(engine)
    fresh_before = fresh.scaler.state_dict()
    annot.load_state(directory, fresh)
    out["round_trip"] = {"saved": saved, "fresh": fresh_before, "loaded": fresh.scaler.state_dict(),
                         "skipped_steps": fresh.skipped_steps}
    return out


def run_all(directory: str, *engines: str) -> dict[str, dict]:
    return {engine: run(f"{directory}/{engine}", engine) for engine in engines}


if __name__ == "__main__":
    worker_main(run_all)
