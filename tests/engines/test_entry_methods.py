"""FSDP2 units called through a method other than ``forward`` (docs/design.md, pitfall
60): a VLM's image tokenizer (Chameleon's, Emu3's VQ-VAE) is a unit its model calls
through ``encode``. One rank is enough: its parameters are DTensors all the same, and
the bare call failed with "got mixed torch.Tensor and DTensor"."""

from __future__ import annotations

import copy

import torch
from torch import nn

import annot
from annot.engines.fsdp2 import ENTRY_METHODS


class Tokenizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called by Model
        return self.conv(x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).tanh()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = Tokenizer()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokenizer.encode(x).transpose(1, 2)).square().mean()


def test_a_unit_called_through_encode_gathers_and_trains_like_the_bare_model(one_rank):
    assert "encode" in ENTRY_METHODS
    torch.manual_seed(0)
    bare = Model()
    model = annot.auto_wrap(copy.deepcopy(bare), "fsdp2", annot.by_class(Tokenizer))
    x = torch.randn(2, 4, 6)
    expected, loss = bare(x), model(x)
    expected.backward()
    loss.backward()
    assert torch.equal(loss.detach(), expected.detach())
    for (name, theirs), mine in zip(bare.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(mine.grad.full_tensor(), theirs.grad, rtol=0, atol=1e-7), name
