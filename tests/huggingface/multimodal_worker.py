"""Run under torchrun by tests/huggingface/test_multimodal.py (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 multimodal_worker.py OUT ROOT CASE...

Each CASE is ``MODEL:SCENARIO``; ROOT/MODEL holds the model and its batches
(`tests.huggingface.multimodal_models.prepare`). Scenarios, each a fresh
``annot.from_pretrained(ROOT/MODEL, "fsdp2", ...)`` and one step:

- ``plain`` and ``checkpoint``: both ranks' batches have images;
- ``mixed``: rank 0's batch has images, rank 1's is text only (checkpointed);
  ``mixed-zero3`` the same on DeepSpeed ZeRO-3 (not checkpointed);
- ``frozen``: ``freeze="vision"``, an AdamW `annot.Trainable`, one step: the loss, the
  gradients, the tower's weights after the step and which parameters the optimizer
  holds state for.

Each case ends as its result (the mean loss over the ranks, every gradient gathered
whole, the number of stand-ins rank 1 ran) or as the error it raised on every rank
(`StandInError` for a model annot refuses to stand in for); a case that fails on one rank
only fails the launch.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import annot
from annot.module_state import peek_state
from tests.distributed import gathered, worker_main
from tests.huggingface.multimodal_models import INPUTS, spec


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _grad(param: torch.nn.Parameter, engine: str) -> torch.Tensor | None:
    """The whole gradient: FSDP2's DTensor gathered, or DeepSpeed's partitions (between
    backward and step)."""
    if engine == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        grad = safe_get_full_grad(param) if param.requires_grad else None
        return None if grad is None else grad.detach().clone()
    return _full(param.grad)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    from annot.huggingface.model import pretrained_inside

    found = pretrained_inside(model)
    assert found is not None
    return found


def step(directory: Path, scenario: str) -> dict[str, Any]:
    rank = dist.get_rank()
    batches = torch.load(directory / INPUTS, weights_only=False)
    mixed = scenario.startswith("mixed")
    batch = batches["text" if mixed and rank == 1 else "images"][rank]
    options: dict[str, Any] = {"device": "cpu", "checkpoint": scenario in ("checkpoint", "mixed"),
                               "torch_dtype": spec(directory.name)[3]}
    engine = "fsdp2"
    if scenario == "frozen":
        options.update(freeze="vision", optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    if scenario == "mixed-zero3":  # ZeRO-3 gathers module by module: the tower first on every rank
        engine = "deepspeed"
        options.update(stage=3, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    wrapped = annot.from_pretrained(directory, engine, **options)
    model = wrapped.model if isinstance(wrapped, annot.Trainable) else wrapped
    loss = wrapped(**batch).loss
    (wrapped.backward if isinstance(wrapped, annot.Trainable) else torch.Tensor.backward)(loss)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    out: dict[str, Any] = {
        "loss": mean.item() / dist.get_world_size(),
        "grads": {n: _grad(p, engine) for n, p in model.named_parameters()},
        "stand_ins": gathered(getattr(peek_state(_hf_model(model)).stand_ins, "stand_ins", 0)),
    }
    if scenario == "frozen":
        assert isinstance(wrapped, annot.Trainable)
        from annot.policies.roles import module_roles

        tower = next(p for p, r in module_roles(_hf_model(model)).items() if r == "vision")
        prefix = next(n for n, m in model.named_modules() if m is _hf_model(model).get_submodule(tower))
        before = {n: _full(p) for n, p in model.named_parameters() if n.startswith(prefix + ".")}
        wrapped.step()
        after = {n: _full(p) for n, p in model.named_parameters() if n.startswith(prefix + ".")}
        held = {id(p) for p in wrapped.optimizer.state}
        out["tower_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        out["tower_params"] = len(before)
        out["tower_state"] = sum(id(p) in held for n, p in model.named_parameters() if n in before)
        out["state"] = len(wrapped.optimizer.state)
    return out


def run(root: str, *cases: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        model_type, scenario = case.split(":")
        try:
            results[case] = step(Path(root) / model_type, scenario)
        except Exception as exc:  # noqa: BLE001 - recorded; every rank must agree (checked below)
            results[case] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(f"rank {dist.get_rank()}: {case}: {results[case]['traceback']}", flush=True)
        errors = gathered(results[case].get("error", "").split(":")[0])
        if len(set(errors)) != 1:
            raise RuntimeError(f"{case}: the ranks ended differently: {errors}\n{results[case]}")
    return results


if __name__ == "__main__":
    worker_main(run)
