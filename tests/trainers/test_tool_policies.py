"""The policies annot hands to other tools work on the module those tools give them:
a deepcopy, a freshly built model, the user's model inside a LightningModule, a tree
already wrapped (docs/design.md, pitfall 15); selecting nothing is an error (pitfall 8);
a transformers model checkpointed through them trains without a key/value cache
(pitfall 14)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import annot
from annot.policies import Policy, by_class, every_nth
from examples.gpt.model import GPT, Block


def gpt() -> GPT:
    return GPT(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def selected(policy, root: nn.Module) -> list[str]:
    chosen = policy._run_policy(root, set(), {})
    return [name for name, module in root.named_modules() if module in chosen]


BLOCKS = [f"transformer.h.{i}" for i in range(4)]


def test_policies_select_the_plans_modules_on_a_deepcopy_and_a_fresh_model():
    planned = gpt()
    wrap, ckpt = annot.fsdp1_policies(planned, Policy(shard=by_class(Block),
                                                       checkpoint=every_nth(2, by_class(Block))))
    for other in (copy.deepcopy(planned), gpt()):
        assert selected(wrap, other) == BLOCKS
        assert selected(ckpt, other) == ["transformer.h.0", "transformer.h.2"]


class Lit(nn.Module):
    """Shaped like a LightningModule that builds its model in configure_model."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.net = gpt()


def test_a_plan_of_the_users_model_finds_it_inside_the_module_the_tool_gets():
    wrap, ckpt = annot.fsdp1_policies(gpt())
    assert selected(wrap, Lit()) == [f"net.{p}" for p in BLOCKS]
    assert selected(ckpt, Lit()) == [f"net.{p}" for p in BLOCKS]


def test_an_already_wrapped_tree_is_read_through_the_wrappers():
    # Lightning applies the checkpointing policy after FSDP1 wrapped the tree; torch's
    # checkpoint_wrapper adds a level the same way FSDP1 does.
    model = gpt()
    _, ckpt = annot.fsdp1_policies(model)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   auto_wrap_policy=ckpt)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrapped == BLOCKS
    wrap, _ = annot.fsdp1_policies(gpt())
    assert [n.replace("._checkpoint_wrapped_module", "") for n in selected(wrap, model)] == BLOCKS


def test_a_policy_that_selects_nothing_is_an_error():
    wrap, ckpt = annot.fsdp1_policies(gpt())
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(annot.PolicySelectionError, match="matches nothing in the Sequential"):
        wrap._run_policy(other, set(), {})
    # A GPT of another depth lacks some of the Plan's units: not the Plan's model.
    with pytest.raises(annot.PolicySelectionError, match="transformer.h.0"):
        ckpt._run_policy(GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16),
                         set(), {})


def test_checkpoint_false_selects_nothing_by_request():
    _, none = annot.fsdp1_policies(gpt(), checkpoint=False)
    assert selected(none, gpt()) == []


def test_lightning_fsdp_strategy_takes_the_policies_and_checkpoints_a_fresh_copy():
    strategies = pytest.importorskip("lightning.pytorch.strategies")
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

    planned = gpt()
    wrap, ckpt = annot.fsdp1_policies(planned, Policy(shard=by_class(Block),
                                                       checkpoint=every_nth(2, by_class(Block))))
    strategy = strategies.FSDPStrategy(auto_wrap_policy=wrap, activation_checkpointing_policy=ckpt)
    assert strategy.kwargs["auto_wrap_policy"] is wrap
    fresh = copy.deepcopy(planned)
    _setup_activation_checkpointing(fresh, strategy._activation_checkpointing_kwargs)
    wrapped = [n for n, m in fresh.named_modules() if isinstance(m, CheckpointWrapper)]
    assert wrapped == ["transformer.h.0", "transformer.h.2"]
    # Each checkpointed block recomputes its forward once in backward.
    calls = {name: 0 for name in BLOCKS}
    for name in BLOCKS:
        block = fresh.get_submodule(name.replace("h.0", "h.0._checkpoint_wrapped_module")
                                    .replace("h.2", "h.2._checkpoint_wrapped_module"))
        block.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    idx = torch.randint(0, 64, (2, 16))
    _, loss = fresh(idx, idx)
    loss.backward()
    assert calls == {"transformer.h.0": 2, "transformer.h.1": 1, "transformer.h.2": 2,
                     "transformer.h.3": 1}


def test_a_transformers_model_checkpointed_through_the_policy_trains_without_a_cache():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    planned = transformers.LlamaForCausalLM(config)
    _, ckpt = annot.fsdp1_policies(planned, checkpoint=True)
    fresh = copy.deepcopy(planned)   # the tool's own instance
    reference = copy.deepcopy(planned)
    assert fresh.config.use_cache is True
    apply_activation_checkpointing(fresh, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   auto_wrap_policy=ckpt)
    assert sum(isinstance(m, CheckpointWrapper) for m in fresh.modules()) == 2
    ids = torch.randint(0, 128, (2, 8))
    out = fresh(input_ids=ids, labels=ids)
    assert out.past_key_values is None  # the forward pre-hook passed use_cache=False
    out.loss.backward()
    assert fresh.config.use_cache is True  # the config is left as the user had it
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=1e-6)
    for (name, a), (_, b) in zip(fresh.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)
