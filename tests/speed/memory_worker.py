"""2-rank worker: the counted peaks of bf16 training steps (FSDP2 or DDP), with and without float8.

Args: OUT ENGINE BATCH SEQ RECIPE... (``ENGINE``: ``fsdp2`` or ``ddp``; ``none``: no
float8). For each recipe, each rank counts (`tests.counted_steps.counted_peak`) while
`tests.speed.cases.memory_model` is built in bfloat16, wrapped by ``annot.auto_wrap(model,
ENGINE, float8=RECIPE, checkpoint=False)`` and trained 3 AdamW steps on BATCH sequences
of SEQ tokens. Rank 0 returns ``{recipe: [peak per rank]}``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import annot
from tests.counted_steps import counted_peak
from tests.distributed import worker_main
from tests.speed.cases import memory_model

STEPS = 3


def _peak(engine: str, batch: int, seq: int, recipe: str) -> int:
    def build() -> torch.nn.Module:
        return annot.auto_wrap(memory_model().to(torch.bfloat16), engine, checkpoint=False,
                               float8=None if recipe == "none" else recipe)
    return counted_peak(build, batch=batch, seq=seq, lr=1e-4, steps=STEPS, after_step=annot.refresh_float8_scales)


def run(engine: str, batch: str, seq: str, *recipes: str) -> dict[str, list[int]]:
    # On a CPU with AVX512-FP16, oneDNN runs float8 matmuls in its reference kernel
    # (measured: 1.6 s for 512 x 256 x 768, three steps of this model past 3 minutes);
    # torch's own CPU kernel gives the same bits in 3.5 ms. The count is the same either
    # way: it sees operators' outputs, not what a kernel does inside.
    torch.backends.mkldnn.enabled = False
    out = {}
    for recipe in recipes:
        peaks: list[int] = [0, 0]
        dist.all_gather_object(peaks, _peak(engine, int(batch), int(seq), recipe))
        out[recipe] = peaks
    return out


if __name__ == "__main__":
    worker_main(run)
