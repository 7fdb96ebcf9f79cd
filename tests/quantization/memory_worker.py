"""2-rank worker: the counted peaks of QLoRA training steps, for the planner's check.

Args: OUT DIR BATCH SEQ [ENGINE] (ENGINE: "fsdp2", the default, or "ddp").

For each of plain and checkpointed (``checkpoint=False``, then ``True``), each rank
counts live tensor bytes (`annot.memory.counting.LiveBytes`, entered before the model is
built, so every storage is seen) while ``annot.from_pretrained(DIR, ENGINE,
peft_config=..., quantize="nf4")`` loads the model and 3 AdamW steps (torch's foreach
step, as the planner prices) train it on BATCH sequences of SEQ tokens per rank; the
peak is taken over the steps (reset after the load). Rank 0 returns
``{"plain": [peak per rank], "checkpoint": [...]}``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import annot
from tests.counted_steps import counted_peak
from tests.distributed import worker_main
from tests.quantization.cases import LR, SEED, lora

STEPS = 3


def _peak(folder: str, batch: int, seq: int, checkpoint: bool, engine: str) -> int:
    def build() -> torch.nn.Module:
        torch.manual_seed(SEED)
        return annot.from_pretrained(folder, engine, peft_config=lora(), quantize="nf4", checkpoint=checkpoint)
    return counted_peak(build, batch=batch, seq=seq, lr=LR, steps=STEPS)


def run(folder: str, batch: str, seq: str, engine: str = "fsdp2") -> dict[str, list[int]]:
    out = {}
    for name, checkpoint in (("plain", False), ("checkpoint", True)):
        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, _peak(folder, int(batch), int(seq), checkpoint, engine))
        out[name] = peaks
    return out


if __name__ == "__main__":
    worker_main(run)
