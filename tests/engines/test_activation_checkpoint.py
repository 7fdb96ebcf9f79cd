"""Run-time activation checkpointing, counted in one process (no engine needed):
what is saved for backward, that blocks are recomputed, that names do not change."""

from __future__ import annotations

import copy

import pytest
import torch

import annot
from annot.policies import Policy, by_class, every_nth
from annot.runtime.activation_checkpoint import (
    apply_checkpointing,
    checkpoint_module,
    checkpointed_paths,
    is_checkpointed,
)
from examples.gpt.model import GPT
from tests.engines.small_gpt import N_LAYER, RecomputeCounter, gpt, tokens


def checkpointed_gpt(**overrides) -> GPT:
    model = gpt(**overrides)
    apply_checkpointing(model, checkpointed_paths(annot.plan(model), None))
    return model


def saved_activation_bytes(model: GPT) -> int:
    """Bytes of distinct activation storages kept for backward by one forward.

    Counts what autograd saves (saved-tensor hooks) plus the inputs of checkpointed
    modules, which the checkpoint itself keeps for recomputation outside those hooks.
    Parameters are left out: they are memory with or without checkpointing.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_inputs(_: torch.nn.Module, args: tuple) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                keep(arg)

    handles = [m.register_forward_pre_hook(keep_inputs) for m in model.modules() if is_checkpointed(m)]
    idx = tokens(model)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(idx, idx)
    for handle in handles:
        handle.remove()
    return sum(kept.values())


def test_per_block_checkpointing_keeps_at_most_one_and_a_half_blocks_of_activations():
    bare = saved_activation_bytes(gpt())
    checkpointed = saved_activation_bytes(checkpointed_gpt())
    assert checkpointed <= bare / N_LAYER * 1.5, (bare, checkpointed)


def test_checkpointed_blocks_are_recomputed_once_each_in_backward():
    bare, model = gpt(), checkpointed_gpt()
    counters = RecomputeCounter(bare), RecomputeCounter(model)
    for counter, m in zip(counters, (bare, model), strict=True):
        counter.step(m)
    assert counters[0].backward_calls == 0
    assert counters[1].backward_calls == N_LAYER


def test_no_recomputation_under_no_grad_or_in_eval_mode():
    model = checkpointed_gpt()
    counter = RecomputeCounter(model)
    with torch.no_grad():
        model(tokens(model))
    assert counter.calls == N_LAYER
    model.eval()
    counter.step(model)  # eval mode with autograd on: blocks run plainly, saving as usual
    assert counter.backward_calls == 0
    assert saved_activation_bytes(model) == saved_activation_bytes(gpt().eval())


def test_loss_and_gradients_equal_the_bare_model():
    bare, model = gpt(), checkpointed_gpt()
    loss_bare, loss = RecomputeCounter(bare).step(bare), RecomputeCounter(model).step(model)
    assert loss.item() == loss_bare.item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_parameter_and_state_dict_names_unchanged():
    bare, model = gpt(), checkpointed_gpt()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in bare.named_parameters()]
    assert list(model.state_dict()) == list(bare.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in bare.named_modules()]
    model.load_state_dict(bare.state_dict())  # keys match both ways


def test_a_deep_copy_recomputes_its_own_blocks():
    model = checkpointed_gpt()
    clone = copy.deepcopy(model)
    counter = RecomputeCounter(clone)
    original = RecomputeCounter(model)
    counter.step(clone)
    assert counter.backward_calls == N_LAYER and original.calls == 0


def test_checkpointing_a_module_twice_is_an_error():
    model = checkpointed_gpt()
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_module(model.transformer.h[0])


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [(None, ["transformer.h.0", "transformer.h.2"]), (True, [f"transformer.h.{i}" for i in range(4)]),
     (False, [])],
)
def test_checkpoint_option_follows_the_plan_or_overrides_it(checkpoint, expected):
    model = gpt()
    plan = annot.plan(model, Policy(shard=by_class(type(model.transformer.h[0])),
                                    checkpoint=every_nth(2, by_class(type(model.transformer.h[0])))))
    assert checkpointed_paths(plan, checkpoint) == expected
