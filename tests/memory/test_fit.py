"""`largest_fit` / ``annot plan --memory --fit``: the search finds the largest fitting
value, and each answer is one the planner itself says fits, with the next one not."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.memory.fit import _search, largest_fit
from examples.gpt.model import GPT

MiB = 2**20


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 9, 100, 1000, 4097])
@pytest.mark.parametrize("curve", ["linear", "affine", "quadratic", "steps"])
def test_the_search_finds_the_largest_fitting_value(limit, curve):
    share = {
        "linear": lambda v: v / limit,
        "affine": lambda v: (v + 0.3 * limit) / (1.3 * limit),
        "quadratic": lambda v: (v / limit) ** 2,
        "steps": lambda v: (v // 3 * 3 + (limit % 3 if v % 3 else 0)) / limit if v <= limit else 2.0,
    }[curve]
    calls = []

    def probe(v):
        calls.append(v)
        s = share(v)
        return s <= 1, int(s * 1000), v, s

    brute = max((v for v in range(1, 5000) if probe(v)[0]), default=None)
    calls.clear()
    for start in (1, 4, 50):
        assert _search(probe, start) == brute, (start, curve, limit)
    assert len(calls) < 80  # a search, not a scan


def _family(layers: int) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, block_size=128)


@pytest.mark.slow
def test_each_answer_fits_and_the_next_does_not():
    limits = dict(gpus=2, seq=128, precision="fp32", gpu_mem=12 * MiB, host_mem=2**30, margin=0.0, reserve=0)
    answers = largest_fit(_family, 4, keys=("ddp", "zero3"), batch=2, **limits)
    for answer in answers:
        assert answer.value is not None and answer.batch is not None
        for value, fits in ((answer.value, True), (answer.value + 1, False)):
            report = annot.estimate_memory(_family(value), batch=2, **limits)
            assert report.row(answer.key).fits_checkpointed is fits, (answer.key, value)
        report = annot.estimate_memory(_family(4), batch=answer.batch + 1, **limits)
        assert not report.row(answer.key).fits_checkpointed
