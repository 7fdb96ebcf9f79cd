"""The planner against the peaks the Lightning + DeepSpeed minGPT benchmark published
(2021): a 1.7B minGPT (15 layers, 16 heads, width 3072, block 128, vocabulary 65),
micro-batch 1, fp16, 8 A100s, each strategy with Lightning 1.3's DeepSpeed plugin
defaults, peak allocated memory per GPU in MiB.

    python examples/bench_mingpt_peaks.py          # prints predicted vs published

The DeepSpeed rows are predicted from the config Lightning 1.3 wrote (`LIGHTNING_13`)
given as ``estimate_memory(..., deepspeed_config=...)``; DDP from the planner's DDP row at
``fp16-mixed`` (DDP under ``torch.autocast``) without bucket views (Lightning 1.3 left
torch's default). Adam steps without a states-sized temporary (``adam-for-loop``: torch
1.8's Adam, DeepSpeed's FusedAdam and CPUAdam). Source of the published figures:
github.com/SeanNaren/minGPT, branch ``stage3``, README ("Smaller Model Comparison").
docs/guides/memory.md says what DeepSpeed 0.3.12, which the benchmark ran, did
otherwise, and what stays unexplained. Nothing is allocated: the model is built on
the meta device and traced under fake tensors. Published peaks are
``torch.cuda.max_memory_allocated`` (the benchmark's CUDA callback), so they are compared
with the counted peak, without the planner's margin and reserve.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import annot  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

MiB = 2**20
SHAPE = dict(vocab_size=65, block_size=128, n_layer=15, n_head=16, n_embd=3072)

#: The ``zero_optimization`` section Lightning 1.3's ``DeepSpeedPlugin`` wrote by default
#: (``stage``, buckets of 2e8, ``overlap_comm`` and ``contiguous_gradients`` on); the
#: ZeRO-3 keys it left out take DeepSpeed's defaults. Precision 16 added ``fp16``.
LIGHTNING_13: dict[str, Any] = {
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "overlap_comm": True,
        "allgather_partitions": True, "reduce_scatter": True,
        "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8,
    },
    "fp16": {"enabled": True, "loss_scale": 0},
}
#: The offload rows: optimizer offload only (``cpu_offload``, Lightning 1.3's
#: ``deepspeed_stage_3_offload``), as minGPT's ``train.py`` at the published commit asks
#: (``DeepSpeedPlugin(stage=3, cpu_offload=True)``); the fp16 parameter partition stays
#: on the GPU. Parameter offload (``cpu_offload_params``) would have to be spelled out.
OFFLOAD = {**LIGHTNING_13, "zero_optimization": {**LIGHTNING_13["zero_optimization"],
                                                 "cpu_offload": True}}

#: (row, published MiB, config or None for DDP, checkpointed).
PUBLISHED: tuple[tuple[str, int, dict[str, Any] | None, bool], ...] = (
    ("DDP", 36_149, None, False),
    ("ZeRO-3", 7_797, LIGHTNING_13, False),
    ("ZeRO-3 + CPU offload", 4_977, OFFLOAD, False),
    ("ZeRO-3 + CPU offload + checkpointing", 2_193, OFFLOAD, True),
)


def predictions() -> list[tuple[str, int, int]]:
    """(row, published MiB, predicted MiB) for each published row."""
    with torch.device("meta"):
        model = GPT(**SHAPE)
    out = []
    for row, published, config, checkpointed in PUBLISHED:
        report = annot.estimate_memory(model, gpus=8, batch=1, seq=128, precision="fp16-mixed",
                                       optimizer="adam-for-loop", deepspeed_config=config,
                                       ddp_options={"gradient_as_bucket_view": False})
        r = report.row("ddp" if config is None else "deepspeed-config")
        predicted = r.gpu_checkpointed if checkpointed else r.gpu
        out.append((row, published, round(predicted / MiB)))
    return out


def main() -> None:
    rows = predictions()
    header = ("strategy", "published MiB", "predicted MiB", "predicted / published")
    lines = [(r, f"{p:,}", f"{q:,}", f"{q / p:.2f}") for r, p, q in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(4)]
    for line in [header, *lines]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
