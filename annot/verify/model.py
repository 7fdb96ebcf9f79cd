"""The model the rows train: a small GPT (token and position embeddings, pre-norm blocks
with torch's scaled-dot-product attention, a final norm, an ``lm_head`` tied to the token
embedding). Its blocks are marked ``@shard_block(checkpoint=True)``, so annot's default
Plan shards and checkpoints each block, as for the example GPT in ``examples/gpt``; it
lives here so that ``python -m annot.verify`` runs from an installed package too."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

from annot.markers import shard_block

__all__ = ["Shape", "TinyGPT", "batches", "flops_per_token"]


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int = 512
    block: int = 64
    layers: int = 2
    heads: int = 4
    width: int = 64
    dropout: float = 0.0


@shard_block(checkpoint=True)
class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads, self.dropout = shape.heads, shape.dropout
        self.ln_1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)
        self.ln_2 = nn.LayerNorm(shape.width)
        self.up = nn.Linear(shape.width, 4 * shape.width)
        self.down = nn.Linear(4 * shape.width, shape.width)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln_2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, shape: Shape = Shape()) -> None:
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.block, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)
        self.lm_head = nn.Linear(shape.width, shape.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, one shard unit
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` from ``idx``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def batches(shape: Shape, count: int, batch: int, device: torch.device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (inputs, targets) pairs of random tokens, the same for every caller."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        data = torch.randint(0, shape.vocab, (batch, shape.block + 1), generator=generator)
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def flops_per_token(model: nn.Module, shape: Shape) -> float:
    """Training FLOPs per token: 6 x parameters (forward and backward matmuls) plus
    attention's 12 x layers x width x sequence (PaLM's count)."""
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params + 12.0 * shape.layers * shape.width * shape.block
