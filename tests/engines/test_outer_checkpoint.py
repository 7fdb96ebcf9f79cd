"""A model whose own forward already checkpoints its blocks (as `annot rewrite` writes it,
or by hand) is not checkpointed a second time by annot's run-time checkpointing."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import annot
from annot.runtime.activation_checkpoint import apply_checkpointing, has_outer_checkpoint
from examples.gpt.model import GPT
from tests.engines.small_gpt import N_LAYER, RecomputeCounter, gpt

BLOCKS = [f"transformer.h.{i}" for i in range(N_LAYER)]

def _deepspeed_non_reentrant(function, *args):
    """What `annot rewrite --target deepspeed` inserts (DeepSpeed imported on first use)."""
    deepspeed = pytest.importorskip("deepspeed")
    return deepspeed.checkpointing.non_reentrant_checkpoint(function, *args)


CHECKPOINTS = {
    # What `annot rewrite --checkpoint torch` inserts.
    "torch-non-reentrant": functools.partial(checkpoint, use_reentrant=False),
    "deepspeed-non-reentrant": _deepspeed_non_reentrant,
    # Reentrant, like deepspeed.checkpointing.checkpoint (which needs DeepSpeed set up).
    "torch-reentrant": functools.partial(checkpoint, use_reentrant=True),
}


class RewrittenGPT(GPT):
    """The example GPT with its block loop as `annot rewrite` leaves it."""

    checkpoint_fn = staticmethod(CHECKPOINTS["torch-non-reentrant"])

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.training and torch.is_grad_enabled():  # annot: checkpoint
                x = self.checkpoint_fn(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def rewritten(kind: str) -> RewrittenGPT:
    torch.manual_seed(0)
    model = RewrittenGPT(n_layer=N_LAYER)
    model.checkpoint_fn = CHECKPOINTS[kind]
    return model


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_blocks_are_recomputed_once_not_twice(kind):
    model = rewritten(kind)
    apply_checkpointing(model, BLOCKS)
    counter = RecomputeCounter(model)
    with pytest.warns(UserWarning, match="Block's forward already runs under an activation checkpoint"):
        counter.step(model)
    assert counter.backward_calls == N_LAYER
    assert all(has_outer_checkpoint(model.get_submodule(p)) for p in BLOCKS)


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_gradients_equal_the_bare_model(kind):
    bare, model = gpt(), rewritten(kind)
    apply_checkpointing(model, BLOCKS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = RecomputeCounter(model).step(model)
    assert loss.item() == RecomputeCounter(bare).step(bare).item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_model_without_its_own_checkpoint_is_still_checkpointed_by_annot():
    model = gpt()
    apply_checkpointing(model, BLOCKS)
    counter = RecomputeCounter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: nothing else checkpoints these blocks
        counter.step(model)
    assert counter.backward_calls == N_LAYER
    assert not any(has_outer_checkpoint(model.get_submodule(p)) for p in BLOCKS)


def test_without_the_check_a_reentrant_outer_checkpoint_would_recompute_twice(monkeypatch):
    """Guards the test above against passing for another reason: with detection off,
    annot's checkpoint nests inside the model's reentrant one (DeepSpeed's kind) and every
    block runs once more in backward. (Nested in torch's non-reentrant checkpoint, torch's
    early stop already avoids the second run; detection still spares the nesting.)"""
    monkeypatch.setattr("annot.runtime.activation_checkpoint.under_outer_checkpoint", lambda: False)
    model = rewritten("torch-reentrant")
    apply_checkpointing(model, BLOCKS)
    counter = RecomputeCounter(model)
    counter.step(model)
    assert counter.backward_calls == 2 * N_LAYER


def test_the_plan_still_lists_the_blocks_as_checkpointed():
    # Detection happens at run time; the Plan says what was asked for.
    assert annot.plan(rewritten("torch-non-reentrant")).paths("checkpoint") == BLOCKS
