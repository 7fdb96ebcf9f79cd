"""FSDP2 units used other than through their own ``forward`` (docs/design.md, pitfalls
60 and 61): a VLM's image tokenizer (Chameleon's, Emu3's VQ-VAE) is a unit its model
calls through ``encode``; DiT and Kosmos-2 call a part of a unit after the unit ran; a
part called before its unit loses its gradient unless refused; and a parameter without
elements (a width-0 layer) is left unsharded. One rank is enough: its parameters are
DTensors all the same, and the bare calls failed with "got mixed torch.Tensor and
DTensor"."""

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


def _trains_like_the_bare_model(bare: nn.Module, unit: type[nn.Module], shape: tuple[int, ...],
                                steps: int = 1, **options: object) -> None:
    """``bare`` and FSDP2 over a copy of it (``unit`` the units) give equal losses over
    ``steps`` steps (gradients accumulating) and gradients within 1e-6."""
    model = annot.auto_wrap(copy.deepcopy(bare), "fsdp2", annot.by_class(unit), **options)
    for step in range(steps):  # a second step starts from units the first resharded
        x = torch.randn(*shape)
        expected, loss = bare(x), model(x)
        expected.backward()
        loss.backward()
        assert torch.equal(loss.detach(), expected.detach()), step
    for (name, theirs), mine in zip(bare.named_parameters(), model.parameters(), strict=True):
        grad = mine.grad.full_tensor() if hasattr(mine.grad, "full_tensor") else mine.grad
        assert grad.shape == theirs.grad.shape and torch.allclose(grad, theirs.grad, rtol=0, atol=1e-6), name


def test_a_unit_called_through_encode_gathers_and_trains_like_the_bare_model(one_rank):
    assert "encode" in ENTRY_METHODS
    torch.manual_seed(0)
    _trains_like_the_bare_model(Model(), Tokenizer, (2, 4, 6))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.emb(x)))


class WidthZeroBlock(Block):
    """A block with a layer of width 0 (the class sweep's tiny NucleusMoE has a dense MLP
    of width 0 in each block): FSDP2's reduce-scatter copy failed on it ("_chunk_cat
    expects non-empty tensor")."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_width = nn.Linear(4, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.unused_width(x).sum()


class CallsAPart(nn.Module):
    """As DiT calls ``transformer_blocks[0].norm1.emb`` again after the blocks, and
    Kosmos-2 its vision unit's ``post_layernorm`` after the vision unit ran."""

    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.blocks[0].emb(x)).square().mean()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_a_part_of_a_unit_called_after_the_unit_gathers_and_trains_like_the_bare_model(one_rank, checkpoint):
    torch.manual_seed(0)
    _trains_like_the_bare_model(CallsAPart(), Block, (3, 4), steps=2,
                                **({"checkpoint": annot.by_class(Block)} if checkpoint else {}))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_a_parameter_without_elements_is_left_unsharded_and_trains_like_the_bare_model(one_rank):
    torch.manual_seed(0)
    _trains_like_the_bare_model(CallsAPart(WidthZeroBlock), WidthZeroBlock, (3, 4))


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
