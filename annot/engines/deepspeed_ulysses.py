"""Ulysses attention through DeepSpeed's own implementation, for context parallelism on
the DeepSpeed engine (``cp_attention="ulysses"``).

DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` wraps a local attention
with its all-to-alls over the sequence-parallel group: the query, key and value of this
rank's part of the sequence, ``(B, t, H, D)``, become ``(B, cp*t, H/cp, D)`` (the whole
sequence for ``H/cp`` heads, the ranks' parts one after the other), the local attention
runs on that, and the result goes back to ``(B, t, H, D)``. Its gradients are DeepSpeed's
inverse all-to-alls.

annot hands DeepSpeed a local attention that first puts the sequence into true order:
each rank holds two load-balanced chunks (`annot.runtime.context_parallel.token_places`),
so the ranks' parts one after the other are not the sequence's order, and causal SDPA
over them would attend to the future (docs/design.md, pitfall 47). The permutation in,
plain causal SDPA, the permutation back: what annot's own Ulysses attention
(`annot.runtime.ulysses_attention`, FSDP2's) does, with DeepSpeed's exchanges.

Head counts: query heads must divide over cp (refused, naming the counts); key/value
heads that do not divide are repeated to the query heads first, exact (DeepSpeed's uneven
head split is not used). Masks, cross attention and KV caches are refused as in
`annot.runtime.split_attention`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from annot.runtime.ulysses_attention import checked_heads, whole_sequence_sdpa

__all__ = ["deepspeed_ulysses_attention"]


def deepspeed_ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                is_causal: bool = False, scale: float | None = None,
                                enable_gqa: bool = False, *, group: dist.ProcessGroup,
                                query_places: torch.Tensor, key_places: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this rank's part of the sequence (``(B, H, t,
    D)`` tensors, SDPA's layout), computed by heads over the whole sequence with
    DeepSpeed's ``DistributedAttention``. ``query_places``: this rank's tokens' places;
    ``key_places``: every rank's, in rank order (the order DeepSpeed's exchange gives)."""
    from deepspeed.sequence.layer import DistributedAttention

    key, value = checked_heads(query, key, value, attn_mask, group=group, query_places=query_places)

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (B, cp*t, H/cp, D) in rank order -> SDPA's (B, H/cp, cp*t, D) in true order and back.
        out = whole_sequence_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_places,
                                  dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                  enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    # scatter heads (dim 2), gather the sequence (dim 1) of (B, t, H, D); batch is dim 0.
    attention = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0)
    return out.transpose(1, 2)
