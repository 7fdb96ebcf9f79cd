"""A parameter without elements (a width-0 layer: the class sweep's tiny NucleusMoE
has a dense MLP of width 0 in each block) trains under FSDP2 like the bare model: FSDP2
leaves it a plain tensor (its reduce-scatter copy failed on it with "_chunk_cat expects
non-empty tensor")."""

from __future__ import annotations

import copy

import torch
from torch import nn

import annot


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.unused_width = nn.Linear(4, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) + self.unused_width(x).sum()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def test_a_parameter_without_elements_trains_like_the_bare_model(one_rank):
    torch.manual_seed(0)
    bare = Model()
    model = annot.auto_wrap(copy.deepcopy(bare), "fsdp2", annot.by_class(Block))
    x = torch.randn(3, 4)
    expected, loss = bare(x), model(x)
    expected.backward()
    loss.backward()
    assert torch.equal(loss.detach(), expected.detach())
    for (name, theirs), mine in zip(bare.named_parameters(), model.parameters(), strict=True):
        grad = mine.grad.full_tensor() if hasattr(mine.grad, "full_tensor") else mine.grad
        assert grad.shape == theirs.grad.shape and torch.allclose(grad, theirs.grad, rtol=0, atol=1e-7), name
