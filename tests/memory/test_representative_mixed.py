"""`annot.memory.representative` on steps whose blocks differ (issue #31, "Speed"): a
budget answer that mixes choices (some blocks ``none``, some ``selective``, ``offload``,
...) traced from one cut model gives the whole model's trace (equal within the 0.1% of
test_representative.py; here exactly), and where the cut cannot stand for the whole
model the whole model is traced."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import annot
from annot.memory import activations, representative
from annot.memory.activations import StepTrace
from annot.memory.budget import BudgetSolver, budget_solver
from annot.memory.representative import LONG_RUN, MIN_BLOCKS, fast_trace_step
from annot.policies import Action
from examples.gpt.model import GPT

TOLERANCE = 0.001  # relative, per figure (as test_representative.py)
BLOCKS = 16
SHAPE = dict(n_layer=BLOCKS, vocab_size=128, block_size=32, n_head=2, n_embd=32)
#: Budget answers as runs of choices: (choice, blocks), in block order.
PATTERNS = {
    "none then selective": [("none", 8), ("selective", 8)],
    "offload, selective, none": [("offload", 7), ("selective", 6), ("none", 3)],
    "four kinds": [("checkpoint", 6), ("checkpoint_offload", 6), ("selective", 2), ("none", 2)],
    "checkpoint around selective": [("checkpoint", 6), ("selective", 4), ("checkpoint", 6)],
}


def _close(a: int, b: int) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1)


def _assert_same(fast: StepTrace, whole: StepTrace) -> None:
    for name in ("peak", "peak_with_grads", "grads", "flops"):
        assert _close(getattr(fast, name), getattr(whole, name)), (name, getattr(fast, name), getattr(whole, name))
    assert [s[:2] for s in fast.segments] == [s[:2] for s in whole.segments]
    for f, w in zip(fast.segments, whole.segments, strict=True):
        assert _close(f[2], w[2]) and _close(f[3], w[3]), (f, w)


def _choices(runs: list[tuple[str, int]]) -> list[str]:
    return [choice for choice, count in runs for _ in range(count)]


def _gpt(**overrides: int) -> nn.Module:
    with torch.device("meta"):
        return GPT(**{**SHAPE, **overrides})


def _solver(model: nn.Module, precision: str = "fp32") -> BudgetSolver:
    return budget_solver(model, gpus=2, batch=2, seq=32, precision=precision, device="cpu",
                         strategies=["fsdp2"], margin=0.0, reserve=0)


def _traced(solver: BudgetSolver, choices: list[str], *, fast: bool) -> StepTrace:
    """The step of ``choices`` (one per block) as the budget traces its answers."""
    s = solver.strategies[0]
    plan = solver.plan_for(dict(zip(solver.paths, choices, strict=True)))
    solver.fast_trace = fast
    return solver.trace_plan(s, plan)


@pytest.fixture
def traced_blocks(monkeypatch):
    """How many blocks of their stack the models traced by the fast path held."""
    counts: list[int] = []
    real = activations.trace_step

    def counting(model, plan, **kwargs):
        stack = representative.block_stack(model, plan)
        counts.append(stack.count if stack is not None else -1)
        return real(model, plan, **kwargs)

    monkeypatch.setattr(representative, "trace_step", counting)
    return counts


# One pattern in the default run (the one with every kind of choice); the rest in the sweep lane.
@pytest.mark.parametrize("pattern", [p if p == "four kinds" else pytest.param(p, marks=pytest.mark.sweep)
                                     for p in PATTERNS])
def test_a_mixed_answer_traced_from_a_cut_equals_the_whole_trace(pattern, traced_blocks):
    solver = _solver(_gpt())
    choices = _choices(PATTERNS[pattern])
    whole = _traced(solver, choices, fast=False)
    fast = _traced(solver, choices, fast=True)
    assert len(traced_blocks) == 1 and traced_blocks[0] < BLOCKS  # one cut trace, never the whole stack
    _assert_same(fast, whole)


@pytest.mark.slow
def test_a_mixed_llama_answer_under_bf16_autocast_equals_the_whole_trace(traced_blocks):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=MIN_BLOCKS + 2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    solver = _solver(model, precision="bf16-mixed")
    choices = _choices([("checkpoint", 7), ("selective", 2), ("offload", 2), ("none", 3)])
    whole = _traced(solver, choices, fast=False)
    fast = _traced(solver, choices, fast=True)
    assert traced_blocks and max(traced_blocks) < MIN_BLOCKS + 2
    _assert_same(fast, whole)


def test_a_user_plan_checkpointing_some_runs_of_blocks_is_traced_from_a_cut(traced_blocks):
    """`fast_trace_step` with the Plan's own checkpointing (no ``prepare``): the first
    blocks checkpointed, the rest not."""
    model = _gpt()
    plan = annot.plan(model)
    first = {f"transformer.h.{i}" for i in range(LONG_RUN)}
    plan = dataclasses.replace(plan, units=tuple(
        u if u.path in first else dataclasses.replace(
            u, actions=tuple(a for a in u.actions if a is not Action.CHECKPOINT))
        for u in plan.units))
    assert set(plan.paths(Action.CHECKPOINT)) == first
    whole = activations.trace_step(model, plan, batch=2, seq=32, checkpoint=True)
    fast = fast_trace_step(model, plan, batch=2, seq=32, checkpoint=True)
    assert max(traced_blocks) < BLOCKS
    _assert_same(fast, whole)


# -- where the cut cannot stand for the whole model: traced whole ----------------------

def test_choices_that_alternate_are_traced_whole(traced_blocks):
    solver = _solver(_gpt())
    choices = ["none", "checkpoint"] * (BLOCKS // 2)  # no run long enough to cut
    whole = _traced(solver, choices, fast=False)
    fast = _traced(solver, choices, fast=True)
    assert traced_blocks == [BLOCKS]
    _assert_same(fast, whole)


@pytest.mark.slow
def test_a_block_that_adds_more_than_its_run_is_traced_whole(traced_blocks):
    """Block 1 (the second of its run, a witness of the cut) saves one more tensor than
    the blocks of its kind around it: the witnesses disagree, so the cut is refused."""
    model = _gpt()
    model.transformer.h[1].mlp.gelu = nn.Sequential(nn.GELU(), nn.Tanh())
    solver = _solver(model)
    choices = _choices(PATTERNS["none then selective"])
    whole = _traced(solver, choices, fast=False)
    fast = _traced(solver, choices, fast=True)
    assert traced_blocks[-1] == BLOCKS and len(traced_blocks) == 2  # the cut, then the whole
    _assert_same(fast, whole)


class _IndexedGPT(GPT):
    """A GPT whose forward reads its blocks by position, as models that loop over a
    configured count do."""

    def forward(self, idx, targets=None, position_ids=None):
        _, t = idx.shape
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i in range(len(self.transformer.h)):
            x = self.transformer.h[i](x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


@pytest.mark.sweep
@pytest.mark.slow
def test_a_model_that_reads_its_blocks_by_position_is_traced_whole(traced_blocks):
    with torch.device("meta"):
        model = _IndexedGPT(**SHAPE)
    solver = _solver(model)
    choices = _choices(PATTERNS["none then selective"])
    whole = _traced(solver, choices, fast=False)
    fast = _traced(solver, choices, fast=True)
    assert traced_blocks[-1] == BLOCKS
    _assert_same(fast, whole)


@pytest.mark.sweep
@pytest.mark.slow
def test_a_config_that_describes_blocks_differently_is_traced_whole(traced_blocks):
    """A config listing a type per block, not all alike (sliding and full attention):
    a forward may read it by a block's place, which a cut block does not keep."""
    model = _gpt()
    model.config.layer_types = ["sliding", "full"] * (BLOCKS // 2)
    solver = _solver(model)
    choices = _choices(PATTERNS["none then selective"])
    fast = _traced(solver, choices, fast=True)
    assert traced_blocks == [BLOCKS]
    _assert_same(fast, _traced(solver, choices, fast=False))


def test_the_model_keeps_its_blocks_after_a_mixed_trace():
    model = _gpt()
    solver = _solver(model)
    _traced(solver, _choices(PATTERNS["none then selective"]), fast=True)
    assert [k for k in model.transformer.h._modules] == [str(i) for i in range(BLOCKS)]


@pytest.mark.slow
def test_a_uniform_plan_of_blocks_described_differently_is_traced_whole(traced_blocks):
    """Gemma 3 (a sliding-window layer type and every fourth full attention): the
    uniform path's 2- and 3-block cuts read the first entries of ``layer_types`` only
    (measured 1.1% over the whole trace's peak before the guard); it traces whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(12)])
    with annot.meta_init():
        model = transformers.Gemma3ForCausalLM(config)
    plan = annot.plan(model)
    kwargs = dict(batch=1, seq=64, checkpoint=True)
    fast = fast_trace_step(model, plan, **kwargs)
    assert traced_blocks == [12]
    _assert_same(fast, activations.trace_step(model, plan, **kwargs))
