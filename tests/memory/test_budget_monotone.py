"""A larger budget never gives a slower predicted step, also where the per-block model
is short of what the answer's trace holds and `BudgetSolver.fit` solves again with a
tighter limit (the Llama-3-8B sweep rose at its last budget so: the re-solve at a large
budget fell below the limit a smaller budget's first answer had fitted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from annot.memory.budget import BudgetError, budget_solver
from examples.gpt.model import GPT

TINY = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32)
#: Budgets from the smallest that fits to twice it, in steps of 2.5%.
FACTORS = [1 + 0.025 * k for k in range(41)]


@pytest.fixture
def short_model_solver():
    """A solver whose traces of answers keeping every block (``none``) hold more than
    the per-block model says: half the plain step's activations more, what a model
    short at light recompute looks like."""
    with torch.device("meta"):
        model = GPT(**TINY)
    solver = budget_solver(model, gpus=2, batch=2, seq=32, precision="fp32", device="cpu",
                           strategies=["fsdp2"], margin=0.0, reserve=0)
    traced = solver._traced
    plain = solver.setting(solver.strategies[0]).trace.peak

    def short(s, blocks):
        trace = traced(s, blocks)
        if any(c != "none" for c in blocks.values()):
            return trace
        solver.kept_all_traced = True
        bump = plain // 2
        return dataclasses.replace(
            trace, peak=trace.peak + bump, peak_with_grads=trace.peak_with_grads + bump,
            segments=tuple((ph, u, top + bump, end + bump) for ph, u, top, end in trace.segments))

    solver._traced = short
    solver.kept_all_traced = False
    return solver


def test_larger_budgets_stay_no_slower_where_the_model_is_short(short_model_solver):
    solver = short_model_solver
    smallest, _ = solver.smallest_budget()
    assert smallest is not None
    steps = []
    for factor in FACTORS:
        budget = int(smallest * factor)
        try:
            answer = solver.fit(budget)
        except BudgetError:
            continue
        assert answer.peak_bytes <= budget
        steps.append(answer.step_time_s)
    assert len(steps) >= 30
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:], strict=False)), steps
    # The re-solve path ran: the model proposed keeping every block, the trace refused it.
    assert solver.kept_all_traced
