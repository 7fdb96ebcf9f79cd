"""The shipped example model accepts what a training loop hands it."""

from __future__ import annotations

import torch

from examples.gpt.model import GPT


def test_targets_sliced_from_one_sequence_need_not_be_contiguous():
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    tokens = torch.randint(0, 32, (2, 9))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # the usual shift: a strided view
    assert not targets.is_contiguous()
    _, loss = model(inputs, targets)
    _, reference = model(inputs, targets.contiguous())
    assert torch.equal(loss, reference)
