"""Run under torchrun by `test_finetune.py`: each fine-tuning case on each engine.

    python -m torch.distributed.run --nproc_per_node 2 finetune_worker.py OUT EXPORTS [CASE:ENGINE ...]

For each ``CASE:ENGINE`` it builds the case's model (`cases.CASES`), wraps it with
``annot.auto_wrap(model, engine, checkpoint=True, optimizer=...)``, trains on this rank's
rows of each batch through the `annot.Trainable` surface, and records the global loss
per step, every parameter afterwards, whole, by its bare name, and the trained model's
logits on a probe batch. Then it saves from the sharded model into EXPORTS/CASE:ENGINE:
a LoRA model as ``adapter`` (PEFT's format) and ``merged``, any other as ``model``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import annot
from tests.distributed import worker_main
from tests.finetune.cases import CASES, ENGINES, make_optimizer, pretrained_lora
from tests.huggingface.hf_archs import batches, probe_inputs, rank_rows

_FSDP1_LEVEL = "_fsdp_wrapped_module."


def full_parameters(trainer: annot.Trainable) -> dict[str, torch.Tensor]:
    """Every parameter of the bare model, whole (collective: every rank calls it)."""
    model = trainer.model
    if trainer.engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.module):
            return {n.replace(_FSDP1_LEVEL, ""): p.detach().clone()
                    for n, p in model.named_parameters()}
    out = {}
    for name, param in model.named_parameters():
        if trainer.engine == "deepspeed" and hasattr(param, "ds_id"):
            import deepspeed

            # One parameter per gather: gathering a long list returned wrong halves on
            # DeepSpeed 0.19 with gloo (docs/design.md notes).
            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.detach().clone()
        else:
            value = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = value.detach().cpu().clone()
    return out


def train(trainer: annot.Trainable, arch: str) -> list[float]:
    """Train on this rank's rows of each batch; the mean loss over ranks per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches(arch):
        loss = trainer(**rank_rows(batch, rank)).loss
        trainer.backward(loss)
        trainer.step()
        trainer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def run_one(case: str, scenario: str, exports: Path) -> dict:
    arch, build = CASES[case]
    engine, options = ENGINES[scenario]
    trainer = annot.auto_wrap(build(), engine, checkpoint=True, optimizer=make_optimizer, **options)
    losses = train(trainer, arch)
    trainer.eval()
    with torch.no_grad():
        logits = trainer(**probe_inputs(arch)).logits.detach().clone()
    target = exports / f"{case}:{scenario}"
    if case == "lora":
        annot.save(trainer, target / "adapter", peft="adapter")
        annot.save(trainer, target / "merged", peft="merged")
    elif case != "lora-bf16":  # its training is the point; the fp32 LoRA exports cover saving
        annot.save(trainer, target / "model")
    return {"losses": losses, "params": full_parameters(trainer), "logits": logits,
            "trainable": sorted(n.replace(_FSDP1_LEVEL, "")
                                for n, p in trainer.model.named_parameters() if p.requires_grad)}


def run_pretrained(scenario: str, directory: Path) -> dict:
    """`annot.from_pretrained` with ``peft_config`` on this engine, then training."""
    engine, options = ENGINES[scenario]
    trainer = pretrained_lora(str(directory), engine, checkpoint=True, optimizer=make_optimizer,
                              **options)
    losses = train(trainer, "llama")
    return {"losses": losses, "params": full_parameters(trainer)}


def run(exports: str, *names: str) -> dict:
    """``CASE:ENGINE`` runs a case; ``pretrained:ENGINE`` loads EXPORTS/base with LoRA."""
    out = {}
    for name in names:
        case, scenario = name.split(":")
        out[name] = (run_pretrained(scenario, Path(exports) / "base") if case == "pretrained"
                     else run_one(case, scenario, Path(exports)))
    return out


if __name__ == "__main__":
    worker_main(run)
