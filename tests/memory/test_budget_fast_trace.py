"""`budget_solver(fast_trace=True)` (the default: a representative few blocks traced and
grown, `annot.memory.representative`) gives the answers of tracing every block, on a
GPT whose 12 blocks make a stack worth cutting."""

from __future__ import annotations

import pytest
import torch

from annot.memory.budget import BudgetError, budget_solver
from annot.memory.representative import MIN_BLOCKS
from examples.gpt.model import GPT

STACK = dict(n_layer=MIN_BLOCKS, n_embd=32, n_head=2, vocab_size=128, block_size=32)
#: Budgets from the smallest that fits to twice it.
FACTORS = (1.0, 1.25, 2.0)


def solver(fast: bool):
    with torch.device("meta"):
        model = GPT(**STACK)
    return budget_solver(model, gpus=2, batch=2, seq=32, precision="fp32", device="cpu",
                         strategies=["fsdp2"], margin=0.0, reserve=0, fast_trace=fast)


@pytest.fixture(scope="module")
def pair():
    return solver(True), solver(False)


def test_the_fast_profiles_and_plain_step_equal_the_whole_trace(pair):
    fast, whole = pair
    s = fast.strategies[0]
    assert fast.setting(s).blocks == whole.setting(s).blocks
    assert fast.setting(s).trace == whole.setting(s).trace


@pytest.mark.slow
def test_the_fast_trace_gives_the_same_answer_at_every_budget(pair):
    fast, whole = pair
    smallest, _ = whole.smallest_budget()
    assert smallest is not None and fast.smallest_budget()[0] == smallest
    answered = 0
    for factor in FACTORS:
        budget = int(smallest * factor)
        try:
            expected = whole.fit(budget)
        except BudgetError:
            with pytest.raises(BudgetError):
                fast.fit(budget)
            continue
        got = fast.fit(budget)
        assert (got.blocks, got.peak_bytes, got.step_time_s) == (
            expected.blocks, expected.peak_bytes, expected.step_time_s), budget
        answered += 1
    assert answered >= 2
