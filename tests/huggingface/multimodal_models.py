"""The models of issue #42's 2-rank checks beyond text LMs: vision-language models
(each rank's batch with real pixel values, or text only) and encoder-decoder, speech and
masked-LM models, some in bfloat16 (T5, with the modules transformers keeps in float32);
tiny configs of the sweep's recipe, saved with ``save_pretrained``, and the
single-process reference (plain transformers in the same dtype, one step per rank's
batch)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

SEED = 0
BATCH = 2  # samples per rank
SEQ = 48
LOSS_RTOL = 1e-5  # relative, on the mean loss
GRAD_ATOL = 1e-4  # absolute, on every element of every gradient
# bfloat16 parameters: each rank's step is one process's, bit for bit, but FSDP2 averages
# the ranks' bfloat16 gradients in bfloat16 where the reference averages them in float32:
# two roundings of 2^-8 each, relative to the gradient, on top of the absolute bound.
BF16_GRAD_RTOL = 2 ** -7

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
#: name -> (model type, class, the sweep's task, dtype): the other classes issue #42 names.
OTHERS = {
    "t5_bf16": ("t5", "T5ForConditionalGeneration", "seq2seq", torch.bfloat16),
    "bert_mlm": ("bert", "BertForMaskedLM", "masked_lm", torch.float32),
    "whisper": ("whisper", "WhisperForConditionalGeneration", "speech_seq2seq", torch.float32),
    "bart": ("bart", "BartForConditionalGeneration", "seq2seq", torch.float32),
    # One layer every depth calls: a unit gathered at each call (list_elements).
    "albert": ("albert", "AlbertForMaskedLM", "masked_lm", torch.float32),
}
INPUTS = "inputs.pt"


def spec(name: str) -> tuple[str, str, str, torch.dtype]:
    """(model type, class, task, dtype) of a model of `VLMS` or `OTHERS`."""
    if name in VLMS:
        return name, VLMS[name], "image_text", torch.float32
    return OTHERS[name]


def build(name: str) -> torch.nn.Module:
    """The tiny model of ``name`` from the shared seed, in its dtype (the modules
    transformers keeps in float32 for it kept so: `annot.huggingface.model.keep_in_fp32_names`)."""
    import transformers

    from annot.huggingface.model import keep_in_fp32_names
    from tests.huggingface.sweep_configs import tiny_config

    model_type, cls, task, dtype = spec(name)
    config = tiny_config(model_type, task=task)
    torch.manual_seed(SEED)
    model = getattr(transformers, cls)(config).to(dtype)
    for path in keep_in_fp32_names(model, dtype):
        model.get_submodule(path).float()
    return model


def rank_inputs(model: torch.nn.Module, rank: int, *, images: bool) -> dict[str, Any]:
    """Rank ``rank``'s batch: `BATCH` samples of `SEQ` tokens, with images or text only."""
    from annot.huggingface.example_inputs import training_inputs

    return training_inputs(model, batch=BATCH, seq=SEQ, generator=torch.Generator().manual_seed(100 + rank),
                           with_images=images)


def prepare(name: str, directory: Path) -> None:
    """Save the tiny model and the batches (both ranks with images or, for a model
    without them, their own batches; and for a VLM rank 1 text only) into ``directory``."""
    model = build(name)
    model.save_pretrained(directory)
    batches = {"images": [rank_inputs(model, r, images=True) for r in range(2)]}
    if name in VLMS:
        batches["text"] = [rank_inputs(model, r, images=False) for r in range(2)]
    torch.save(batches, directory / INPUTS)


@dataclasses.dataclass(frozen=True)
class Step:
    """The reference: the mean loss and gradients of the ranks' steps, and each
    gradient's scale (the mean of the ranks' absolute values: what rounding errors of a
    16-bit average are relative to, however the ranks' values cancel)."""

    loss: float
    grads: dict[str, torch.Tensor]
    scale: dict[str, torch.Tensor]


def reference(directory: Path, batches: list[dict[str, Any]], *, frozen: tuple[str, ...] = ()) -> Step:
    """Plain transformers in this process: one step on each batch (what each rank does),
    the mean of their losses and of their gradients (what data parallelism averages)."""
    import transformers

    import annot

    _, cls_name, _, dtype = spec(directory.name)
    cls = getattr(transformers, cls_name)
    losses, grads = [], []
    for batch in batches:
        model = cls.from_pretrained(directory, dtype=dtype).train()
        if frozen:
            annot.freeze(model, *frozen)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None})
    names = set().union(*grads)

    def mean(name: str, of: Any) -> torch.Tensor:
        like = next(g[name] for g in grads if name in g)
        return sum(of(g[name]) if name in g else torch.zeros_like(like) for g in grads) / len(grads)

    return Step(sum(losses) / len(losses), {n: mean(n, lambda t: t) for n in names},
                {n: mean(n, torch.abs) for n in names})


def compare(reference_step: Step, got: dict[str, Any], dtype: torch.dtype = torch.float32) -> list[str]:
    """What differs between the reference and a 2-rank step (in ``dtype``) beyond the bounds."""
    rtol = BF16_GRAD_RTOL if dtype == torch.bfloat16 else 0.0
    ref_loss, ref_grads = reference_step.loss, reference_step.grads
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
        bound = GRAD_ATOL + rtol * reference_step.scale[name]
        excess = ((grad.float() - ref.float()).abs() - bound).max().item()
        if not excess <= 0:
            problems.append(f"gradient of {name} off by {excess:.2e} beyond the bound")
    extra = [n for n, g in grads.items() if n not in ref_grads and g is not None and g.abs().max() > 0]
    if extra:
        problems.append(f"gradients transformers has not: {extra[:5]}")
    return problems
