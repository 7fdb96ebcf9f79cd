"""`annot.memory.representative`: a stack of identical blocks traced at 2 and 3 blocks and
grown to the whole model gives the whole model's trace (here exactly; the module allows
0.1%), without ever tracing all the blocks."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.memory import activations, representative
from annot.memory.representative import (
    MIN_BLOCKS,
    block_stack,
    fast_trace_activations,
    fast_trace_step,
)
from examples.gpt.model import GPT

TOLERANCE = 0.001  # relative, per figure
SHAPE = dict(vocab_size=128, block_size=16, n_head=2, n_embd=32)


def _gpt(n_layer: int) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(n_layer=n_layer, **SHAPE)


def _close(a: int, b: int) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1)


@pytest.fixture
def traced_block_counts(monkeypatch):
    """How many blocks each model traced by the fast path held."""
    counts: list[int] = []
    real = activations.trace_step

    def counting(model, plan, **kwargs):
        counts.append(len(model.get_submodule("transformer.h")))
        return real(model, plan, **kwargs)

    monkeypatch.setattr(representative, "trace_step", counting)
    return counts


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_grown_step_trace_equals_the_whole_trace(checkpoint, traced_block_counts):
    model = _gpt(MIN_BLOCKS)
    plan = annot.plan(model)
    whole = activations.trace_step(model, plan, batch=2, seq=16, checkpoint=checkpoint,
                                   autocast=torch.bfloat16)
    grown = fast_trace_step(model, plan, batch=2, seq=16, checkpoint=checkpoint, autocast=torch.bfloat16)
    assert max(traced_block_counts) == 3  # never the whole stack
    for name in ("peak", "peak_with_grads", "grads", "flops"):
        assert _close(getattr(grown, name), getattr(whole, name)), name
    assert [s[:2] for s in grown.segments] == [s[:2] for s in whole.segments]
    for g, w in zip(grown.segments, whole.segments, strict=True):
        assert _close(g[2], w[2]) and _close(g[3], w[3]), (g, w)


def test_the_grown_activation_estimate_equals_the_whole_one():
    model = _gpt(MIN_BLOCKS)
    plan = annot.plan(model)
    whole = activations.trace_activations(model, plan, batch=2, seq=16)
    grown = fast_trace_activations(model, plan, batch=2, seq=16)
    assert _close(grown.saved, whole.saved)
    assert _close(grown.saved_checkpointed, whole.saved_checkpointed)
    assert grown.per_unit.keys() == whole.per_unit.keys()
    assert all(_close(grown.per_unit[k], whole.per_unit[k]) for k in whole.per_unit)


def test_a_short_stack_is_traced_whole():
    model = _gpt(MIN_BLOCKS - 1)
    assert block_stack(model, annot.plan(model)) is None
    assert block_stack(_gpt(MIN_BLOCKS), annot.plan(_gpt(MIN_BLOCKS))) is not None


def test_the_model_keeps_its_blocks():
    model = _gpt(MIN_BLOCKS)
    fast_trace_step(model, annot.plan(model), batch=1, seq=8, checkpoint=False)
    assert len(model.transformer.h) == MIN_BLOCKS
