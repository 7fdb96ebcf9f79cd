"""The shipped example model accepts what a training loop hands it."""

from __future__ import annotations

import math

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


def _attention_by_hand(attn, x: torch.Tensor) -> torch.Tensor:
    """The example's attention as it was written before scaled_dot_product_attention: the
    (B, n_head, T, T) scores, masked, softmaxed (no dropout)."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~attn.mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
    return attn.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


def test_fused_attention_matches_the_scores_computed_by_hand():
    """fp32 on CPU: outputs within 1e-6 and every gradient within 1e-6 of the old path."""
    torch.manual_seed(0)
    attn = GPT(n_layer=1, n_embd=32, n_head=4, block_size=16).transformer.h[0].attn
    x = torch.randn(3, 12, 32, requires_grad=True)  # T < block_size: the mask is sliced
    fused, by_hand = attn(x), _attention_by_hand(attn, x)
    torch.testing.assert_close(fused, by_hand, rtol=0, atol=1e-6)
    weights = [x, *attn.parameters()]
    grads = torch.autograd.grad(fused.square().sum(), weights)
    reference = torch.autograd.grad(by_hand.square().sum(), weights)
    for got, want in zip(grads, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_attention_dropout_is_applied_in_training_only():
    torch.manual_seed(0)
    attn = GPT(n_layer=1, n_embd=32, n_head=4, block_size=16, dropout=0.5).transformer.h[0].attn
    attn.resid_dropout = torch.nn.Identity()  # only the attention weights' dropout left
    x = torch.randn(2, 8, 32)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    assert not torch.equal(attn(x), attn(x))
