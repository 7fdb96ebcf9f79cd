"""Run under torchrun by tests/huggingface/test_diffusers.py (2 CPU ranks, gloo).

    python -m torch.distributed.run --nproc_per_node 2 diffusers_worker.py OUT ROOT CASE...

Each CASE is ``NAME:SCENARIO`` and ROOT/NAME a pipeline folder
(`tests.huggingface.diffusers_models.save_pipeline`): ``annot.from_pretrained`` of the
pipeline folder (its denoiser, ``transformer/``) with FSDP2, plain (``plain``) or
checkpointed (``checkpoint``), one flow-matching step on this rank's batch: the mean
loss and every gradient gathered whole. ``save`` also writes the loaded model with
``annot.save`` into ROOT/NAME/saved from both ranks; ``components`` loads the pipeline's
VAE and text encoder frozen for the forward only (`frozen_components`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import annot
from annot.huggingface.denoiser_inputs import flow_matching_loss
from tests.distributed import gathered, worker_main
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


def frozen_components(root: Path) -> dict[str, Any]:
    """The pipeline's VAE and text encoder loaded sharded and frozen (``freeze="all"``),
    forward only: their outputs against the libraries' own loads in this rank."""
    import diffusers
    import transformers

    torch.manual_seed(dist.get_rank())
    pixels, ids = torch.randn(1, 3, 16, 16), torch.randint(0, 64, (1, 8))
    vae = annot.from_pretrained(root, "fsdp2", component="vae", freeze="all", device="cpu")
    encoder = annot.from_pretrained(root, "fsdp2", component="text_encoder", freeze="all", device="cpu")
    plain_vae = diffusers.AutoencoderKL.from_pretrained(root / "vae")
    plain_encoder = transformers.CLIPTextModel.from_pretrained(root / "text_encoder")
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean  # a method, not forward: FSDP2 registered it
        images = vae.decode(latents).sample
        hidden = encoder(input_ids=ids).last_hidden_state
        return {"vae_encode": torch.equal(latents, plain_vae.encode(pixels).latent_dist.mean),
                "vae_decode": torch.equal(images, plain_vae.decode(latents).sample),
                "text_encoder": torch.equal(hidden, plain_encoder(input_ids=ids).last_hidden_state),
                "trainable": sum(p.requires_grad for p in [*vae.parameters(), *encoder.parameters()])}


def run(root: str, *cases: str) -> dict[str, Any]:
    out = {}
    for case in cases:
        name, scenario = case.split(":")
        if scenario == "components":
            out[case] = gathered(frozen_components(Path(root) / name))
            continue
        out[case] = step(Path(root) / name, name, scenario)
    return out


if __name__ == "__main__":
    worker_main(run)
