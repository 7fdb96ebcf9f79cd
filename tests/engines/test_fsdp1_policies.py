"""The Plan as FSDP1 / Lightning policies: they select exactly the Plan's modules."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.wrap import _Policy

import annot
from annot.policies import Policy, by_class, by_name, every_nth
from examples.gpt.model import GPT, Block


def selected(policy: _Policy, model: torch.nn.Module) -> list[str]:
    # What FSDP1 (and Lightning, which hands the policy to torch) would wrap.
    chosen = policy._run_policy(model, set(), {})
    return [name for name, module in model.named_modules() if module in chosen]


@pytest.fixture
def model() -> GPT:
    return GPT(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def test_policies_from_the_marks(model):
    wrap, checkpoint = annot.fsdp1_policies(model)
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert isinstance(wrap, _Policy) and isinstance(checkpoint, _Policy)
    assert selected(wrap, model) == blocks
    assert selected(checkpoint, model) == blocks


def test_policies_follow_every_nth_and_the_checkpoint_option(model):
    policy = Policy(shard=by_class(Block), checkpoint=every_nth(2, by_class(Block)))
    _, checkpoint = annot.fsdp1_policies(model, policy)
    assert selected(checkpoint, model) == ["transformer.h.0", "transformer.h.2"]
    _, none = annot.fsdp1_policies(model, policy, checkpoint=False)
    assert selected(none, model) == []


def test_a_tied_group_cannot_be_one_fsdp1_unit(model):
    policy = Policy(shard=by_name("transformer.wte", "lm_head"), group_tied=True)
    with pytest.raises(annot.EngineNotAvailableError, match="fsdp2"):
        annot.fsdp1_policies(model, policy)
