"""The diffusion transformers of issue #42's checks (Flux, SD3, Wan): tiny configs from
the probe's recipe, a pipeline folder around each (``model_index.json`` and the
component folders diffusers writes), each rank's flow-matching batch, and the
single-process reference (diffusers' own ``from_pretrained``, one step per rank's
batch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SEED = 0
BATCH = 2
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4
# bfloat16 parameters (Wan as diffusers loads it in bf16): each rank's step is one
# process's, bit for bit, but FSDP2 averages the two ranks' bfloat16 gradients in
# bfloat16 where the reference averages them in float32: two roundings of 2^-8 each, on
# top of the absolute bound.
BF16_GRAD_RTOL = 2 ** -7

#: name -> (class, dtype it is loaded in)
DENOISERS = {
    "flux": ("FluxTransformer2DModel", torch.float32),
    "sd3": ("SD3Transformer2DModel", torch.float32),
    "wan": ("WanTransformer3DModel", torch.float32),
    "wan_bf16": ("WanTransformer3DModel", torch.bfloat16),
}
BATCHES = "batches.pt"


def build(name: str) -> torch.nn.Module:
    import diffusers

    from tests.huggingface.diffusers_configs import tiny_denoiser_config

    cls_name, _ = DENOISERS[name]
    torch.manual_seed(SEED)
    return getattr(diffusers, cls_name).from_config(tiny_denoiser_config(cls_name))


def save_in_pipeline(model: torch.nn.Module, root: Path, *, frozen_parts: bool = False) -> Path:
    """Save the diffusers denoiser ``model`` as the ``transformer`` component of a
    pipeline folder ``root`` (its ``model_index.json`` naming it, and with
    ``frozen_parts`` a tiny VAE and text encoder beside it: `save_frozen_components`);
    returns the component's folder."""
    import diffusers

    model.save_pretrained(root / "transformer")
    components = {"transformer": ["diffusers", type(model).__name__], "scheduler": [None, None]}
    if frozen_parts:
        save_frozen_components(root)
        components.update(vae=["diffusers", "AutoencoderKL"], text_encoder=["transformers", "CLIPTextModel"])
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "TinyPipeline", "_diffusers_version": diffusers.__version__, **components}))
    return root / "transformer"


def save_pipeline(name: str, root: Path) -> Path:
    """A pipeline folder holding the tiny denoiser of ``name`` as ``transformer/`` and its
    batches (per rank, in the dtype the model is loaded in)."""
    from annot.huggingface.denoiser_inputs import denoiser_inputs

    model = build(name)
    dtype = DENOISERS[name][1]
    save_in_pipeline(model, root, frozen_parts=name == "flux")  # the pipeline's frozen parts too
    batches = [denoiser_inputs(model.to(dtype), batch=BATCH, generator=torch.Generator().manual_seed(100 + rank))
               for rank in range(2)]
    torch.save(batches, root / BATCHES)
    return root


def save_frozen_components(root: Path) -> None:
    """A tiny VAE and CLIP text encoder into ``root/vae`` and ``root/text_encoder``."""
    import diffusers
    import transformers

    torch.manual_seed(SEED)
    diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
        norm_num_groups=4, layers_per_block=1).save_pretrained(root / "vae")
    transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)).save_pretrained(root / "text_encoder")


def loaded(name: str, root: Path) -> torch.nn.Module:
    """diffusers' own load of the pipeline's denoiser, in the test's dtype."""
    import diffusers

    cls_name, dtype = DENOISERS[name]
    return getattr(diffusers, cls_name).from_pretrained(root / "transformer", torch_dtype=dtype)


def reference(name: str, root: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of diffusers' load per rank's batch: the mean loss and mean gradients."""
    from annot.huggingface.denoiser_inputs import flow_matching_loss

    losses, grads = [], []
    for inputs, target in torch.load(root / BATCHES, weights_only=False):
        model = loaded(name, root).train()
        loss = flow_matching_loss(model, inputs, target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
    return sum(losses) / len(losses), {n: sum(g[n] for g in grads) / len(grads) for n in grads[0]}


def compare(name: str, ref: tuple[float, dict[str, torch.Tensor]], got: dict[str, Any]) -> list[str]:
    rtol = BF16_GRAD_RTOL if DENOISERS[name][1] == torch.bfloat16 else 0.0
    ref_loss, ref_grads = ref
    problems = []
    if not abs(got["loss"] - ref_loss) <= LOSS_RTOL * abs(ref_loss):
        problems.append(f"loss {got['loss']!r} vs {ref_loss!r}")
    for param, grad in ref_grads.items():
        mine = got["grads"].get(param)
        if mine is None:
            problems.append(f"no gradient for {param}")
            continue
        excess = ((mine.float() - grad).abs() - (GRAD_ATOL + rtol * grad.abs())).max().item()
        if not excess <= 0:
            problems.append(f"gradient of {param} off by {excess:.2e} beyond the bound")
    return problems
