"""A mixture-of-experts model of the user's own: not a transformers ``PreTrainedModel``
(no ``ep_plan``, no config class of its own), a nanoGPT-shaped decoder whose feed-forward
is transformers' ``MixtralSparseMoeBlock`` (its router and fused experts), as a user
composing library blocks writes one. Expert parallelism finds its experts by annot's
rule (3-D stacks of one row per expert) and checks transformers' experts contract
(`annot.huggingface.expert_parallel._own_plan`)."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 (torch's own spelling)

import annot


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@annot.shard_block
class Block(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config.hidden_size, config.num_attention_heads)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.moe = MixtralSparseMoeBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class OwnMoe(nn.Module):
    """Token ids in, ``.loss`` (next-token cross-entropy) and ``.logits`` out. ``config``:
    a ``MixtralConfig`` (its sizes and its experts' implementation)."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "_experts_implementation", None) is None:
            config._experts_implementation = "grouped_mm"  # what a PreTrainedModel sets
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # transformers' router and experts allocate with torch.empty (its PreTrainedModel
        # initializes them): a model of one's own initializes them itself.
        for block in self.h:
            for param in block.moe.parameters():
                nn.init.normal_(param, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> types.SimpleNamespace:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss, logits=logits)
