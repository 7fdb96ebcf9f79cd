"""Every architecture of the matrix built under `annot.meta_init` and materialized equals
eager construction bitwise (parameters and buffers, non-persistent ones included).

This covers two things transformers models need from the recorder: torch 2.13's
rejection-sampling ``trunc_normal_`` (ViT's init; value-dependent, so recorded as one
opaque operation) and scalar constants made by ``torch.tensor(x)`` in a constructor
(Gemma's ``embed_scale``), which reach the record only as fake tensors."""

from __future__ import annotations

import pytest
import torch

import annot
from tests.huggingface.hf_archs import ARCHS, SEED


def _everything(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(ARCHS))
def test_materialized_equals_eager(name):
    arch = ARCHS[name]
    eager = arch.build()
    torch.manual_seed(SEED)
    with annot.meta_init():
        deferred = arch.model_cls()(arch.config())
    assert all(t.is_meta for t in _everything(deferred).values())
    annot.materialize(deferred)
    expected, actual = _everything(eager), _everything(deferred)
    assert set(actual) == set(expected)
    assert [n for n in expected if not torch.equal(expected[n], actual[n])] == []


def test_trunc_normal_outside_meta_init_is_torch_own():
    """The patch is active only inside the block."""
    torch.manual_seed(1)
    a = torch.nn.init.trunc_normal_(torch.empty(1000), std=0.5)
    with annot.meta_init():
        torch.nn.Linear(2, 2)
    torch.manual_seed(1)
    b = torch.nn.init.trunc_normal_(torch.empty(1000), std=0.5)
    assert torch.equal(a, b) and a.abs().max() <= 2.0
