"""FSDP2 units called through a method other than ``forward`` (docs/design.md, pitfall
60): a VLM's image tokenizer (Chameleon's, Emu3's VQ-VAE) is a unit its model calls
through ``encode``. One rank is enough: its parameters are DTensors all the same, and
the bare call failed with "got mixed torch.Tensor and DTensor"."""

from __future__ import annotations

import copy

import pytest
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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.emb(x)))


class CallsAPart(nn.Module):
    """As DiT calls ``transformer_blocks[0].norm1.emb`` again after the blocks, and
    Kosmos-2 its vision unit's ``post_layernorm`` after the vision unit ran."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.blocks[0].emb(x)).square().mean()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_a_part_of_a_unit_called_after_the_unit_gathers_and_trains_like_the_bare_model(one_rank, checkpoint):
    torch.manual_seed(0)
    bare = CallsAPart()
    model = annot.auto_wrap(copy.deepcopy(bare), "fsdp2", annot.by_class(Block),
                            **({"checkpoint": annot.by_class(Block)} if checkpoint else {}))
    for step in range(2):  # the second step starts from units the first resharded
        x = torch.randn(3, 4)
        expected, loss = bare(x), model(x)
        expected.backward()
        loss.backward()
        assert torch.equal(loss.detach(), expected.detach()), step
    for (name, theirs), mine in zip(bare.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(mine.grad.full_tensor(), theirs.grad, rtol=0, atol=1e-6), name


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        return self.norm(embedded)


class EmbedsBeforeTheUnit(nn.Module):
    """As ModernVBERT embeds its text through ``get_input_embeddings()`` (a part of its
    embeddings unit) and then runs that unit on the result."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embeddings(self.embeddings.tok(ids))).square().mean()


def test_a_part_called_before_its_unit_fails_in_backward_rather_than_lose_its_gradient(one_rank):
    """The part's backward comes after FSDP2 reduced the unit's gradients: an embedding's
    backward reads no weight, so its gradient was dropped without a word."""
    model = annot.auto_wrap(EmbedsBeforeTheUnit(), "fsdp2", annot.by_class(Embeddings))
    loss = model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(annot.EngineNotAvailableError, match="Embedding inside the FSDP2 unit Embeddings is called"):
        loss.backward()
