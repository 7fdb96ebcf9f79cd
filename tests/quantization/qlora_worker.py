"""2-rank worker: ``annot.from_pretrained(DIR, "fsdp2", peft_config=..., quantize="nf4")``
trained for `STEPS` steps of AdamW; rank 0 returns each step's mean loss, the
adapters' gradients (gathered whole) and each rank's digest of its quantized bytes.

Args: OUT DIR [checkpoint] [offload] [ddp] [save=FOLDER]. ``ddp``: engine "ddp" instead.

With ``save=FOLDER`` the same launch also saves and resumes: ``annot.save_state`` after
`RESUME_AT` steps, then after the last step the adapters (``peft="adapter"``), the merged
model (``peft="merged"``, in the model's fp32 and in bf16) and the logits of `PROBE` (every rank the same rows); then a
second model, built with other adapter values, ``annot.load_state`` of that state and
trains the remaining steps on the same rows: their losses come back as ``resumed``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main
from tests.quantization.cases import (
    BATCHES,
    LR,
    PROBE,
    RESUME_AT,
    SEED,
    adapter_grads,
    lora,
    quantized_digest,
)


def _build(folder: str, flags: tuple[str, ...], seed: int) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    engine = "ddp" if "ddp" in flags else "fsdp2"
    options = {"offload": True} if "offload" in flags else {}
    model = annot.from_pretrained(folder, engine, peft_config=lora(), quantize="nf4",
                                  checkpoint="checkpoint" in flags, **options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    return model, optimizer


def _step(model: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, dict]:
    """One step on this rank's rows of ``tokens``: the mean loss over the ranks and the
    adapters' gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = tokens.shape[0] // world
    rows = tokens[rank * per_rank:(rank + 1) * per_rank]
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    grads = adapter_grads(getattr(model, "module", model))  # DDP's names without "module."
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world, grads


def run(folder: str, *flags: str) -> dict:
    saves = [flag.removeprefix("save=") for flag in flags if flag.startswith("save=")]
    out = Path(saves[0]) if saves else None
    model, optimizer = _build(folder, flags, SEED)
    losses, grads = [], []
    for step, tokens in enumerate(BATCHES):
        if out is not None and step == RESUME_AT:
            annot.save_state(out / "state", annot.Trainable(model, model, optimizer, "fsdp2"), step=step)
        loss, step_grads = _step(model, optimizer, tokens)
        losses.append(loss)
        grads.append(step_grads)
    quantized = sum(type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" for p in model.parameters())
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, quantized_digest(model))
    result: dict[str, Any] = {"losses": losses, "grads": grads, "quantized": quantized, "digests": digests}
    if out is None:
        return result
    annot.save(model, out / "adapter", peft="adapter")
    annot.save(model, out / "merged", peft="merged")
    annot.save(model, out / "merged-bf16", peft="merged", dtype=torch.bfloat16)
    with torch.no_grad():
        result["logits"] = model(input_ids=PROBE).logits.detach().clone()
    del model, optimizer
    model, optimizer = _build(folder, flags, SEED + 1)
    resumed = annot.load_state(out / "state", annot.Trainable(model, model, optimizer, "fsdp2"))
    result["resumed"] = [_step(model, optimizer, tokens)[0] for tokens in BATCHES[resumed.step:]]
    return result


if __name__ == "__main__":
    worker_main(run)
