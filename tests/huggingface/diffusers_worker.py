"""Run under torchrun by tests/huggingface/test_diffusers.py (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 diffusers_worker.py OUT ROOT CASE...

Each CASE is ``NAME:SCENARIO`` and ROOT/NAME a pipeline folder
(`tests.huggingface.diffusers_models.save_pipeline`): ``annot.from_pretrained`` of the
pipeline folder (its denoiser, ``transformer/``) with FSDP2, plain (``plain``) or
checkpointed (``checkpoint``), one flow-matching step on this rank's batch: the mean
loss and every gradient gathered whole. ``save`` also writes the loaded model with
``annot.save`` into ROOT/NAME/saved from both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import annot
from annot.huggingface.denoiser_inputs import flow_matching_loss
from tests.distributed import worker_main
from tests.huggingface.diffusers_models import BATCHES, DENOISERS


def step(root: Path, name: str, scenario: str) -> dict[str, Any]:
    rank = dist.get_rank()
    inputs, target = torch.load(root / BATCHES, weights_only=False)[rank]
    model = annot.from_pretrained(root, "fsdp2", device="cpu", torch_dtype=DENOISERS[name][1],
                                  checkpoint=scenario == "checkpoint")
    if scenario == "save":
        annot.save(model, root / "saved")
        return {}
    loss = flow_matching_loss(model, inputs, target)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    grads = {}
    for param_name, param in model.named_parameters():
        grad = param.grad
        grads[param_name] = None if grad is None else grad.full_tensor().detach().clone()
    return {"loss": mean.item() / dist.get_world_size(), "grads": grads}


def run(root: str, *cases: str) -> dict[str, Any]:
    out = {}
    for case in cases:
        name, scenario = case.split(":")
        out[case] = step(Path(root) / name, name, scenario)
    return out


if __name__ == "__main__":
    worker_main(run)
