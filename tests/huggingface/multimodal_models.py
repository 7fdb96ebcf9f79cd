"""The vision-language models of issue #42's checks: tiny configs of the sweep's recipe,
saved with ``save_pretrained``, each rank's batch with real pixel values (or text only),
and the single-process reference (plain transformers, one step per rank's batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SEED = 0
BATCH = 2  # samples per rank
SEQ = 48
LOSS_RTOL = 1e-5  # relative, on the mean loss
GRAD_ATOL = 1e-4  # absolute, on every element of every gradient

#: model type -> the class the test trains.
VLMS = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "mllama": "MllamaForConditionalGeneration",
    "paligemma": "PaliGemmaForConditionalGeneration",
}
INPUTS = "inputs.pt"


def build(model_type: str) -> torch.nn.Module:
    """The tiny model of ``model_type`` from the shared seed."""
    import transformers

    from tests.huggingface.sweep_configs import tiny_config

    config = tiny_config(model_type, task="image_text")
    torch.manual_seed(SEED)
    return getattr(transformers, VLMS[model_type])(config)


def rank_inputs(model: torch.nn.Module, rank: int, *, images: bool) -> dict[str, Any]:
    """Rank ``rank``'s batch: `BATCH` samples of `SEQ` tokens, with images or text only."""
    from annot.huggingface.example_inputs import training_inputs

    return training_inputs(model, batch=BATCH, seq=SEQ, generator=torch.Generator().manual_seed(100 + rank),
                           with_images=images)


def prepare(model_type: str, directory: Path) -> None:
    """Save the tiny model and the batches (both ranks with images, and rank 1 text only)
    into ``directory``."""
    model = build(model_type)
    model.save_pretrained(directory)
    batches = {"images": [rank_inputs(model, r, images=True) for r in range(2)],
               "text": [rank_inputs(model, r, images=False) for r in range(2)]}
    torch.save(batches, directory / INPUTS)


def reference(directory: Path, batches: list[dict[str, Any]], *, frozen: tuple[str, ...] = ()
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain transformers in this process: one step on each batch (what each rank does),
    the mean of their losses and of their gradients (what data parallelism averages)."""
    import transformers

    import annot

    cls = getattr(transformers, VLMS[directory.name])
    losses, grads = [], []
    for batch in batches:
        model = cls.from_pretrained(directory).train()
        if frozen:
            annot.freeze(model, *frozen)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    names = set().union(*grads)
    mean = {n: sum(g[n] if n in g else torch.zeros_like(next(h[n] for h in grads if n in h)) for g in grads)
            / len(grads) for n in names}
    return sum(losses) / len(losses), mean


def compare(reference_step: tuple[float, dict[str, torch.Tensor]], got: dict[str, Any]) -> list[str]:
    """What differs between the reference and a 2-rank step beyond the bounds."""
    ref_loss, ref_grads = reference_step
    problems = []
    if not abs(got["loss"] - ref_loss) <= LOSS_RTOL * abs(ref_loss):
        problems.append(f"loss {got['loss']!r} vs {ref_loss!r}")
    grads = got["grads"]
    for name, ref in ref_grads.items():
        grad = grads.get(name)
        if grad is None:
            if ref.abs().max() > 0:
                problems.append(f"no gradient for {name}")
            continue
        gap = (grad.float() - ref.float()).abs().max().item()
        if not gap <= GRAD_ATOL:
            problems.append(f"gradient of {name} off by {gap:.2e}")
    extra = [n for n, g in grads.items() if n not in ref_grads and g is not None and g.abs().max() > 0]
    if extra:
        problems.append(f"gradients transformers has not: {extra[:5]}")
    return problems
