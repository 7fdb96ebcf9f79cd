"""Ulysses attention: context parallelism by an all-to-all over attention heads.

The second way `annot.runtime.context_parallel` splits attention (FSDP2's
``cp_attention="ulysses"``; the first, the default, is `annot.runtime.split_attention`'s
all-gather of keys and values). Each rank of the cp group holds its part of the
sequence (two load-balanced chunks, `token_places`) for every head. For one SDPA call:

1. an all-to-all (`heads_to_sequence`) sends head group ``j`` (``heads / cp`` heads) of
   this rank's part to rank ``j``: afterwards each rank holds the whole sequence for its
   heads only, in rank order of the parts (``key_places``: rank 0's places, then rank 1's);
2. the sequence is put back into true order (a permutation by the places), so plain
   causal SDPA (``is_causal=True``: flash kernels, no mask tensor) is exact;
3. the result is put back into rank order and an all-to-all (`sequence_to_heads`)
   returns to each rank its part of the sequence for every head.

Each all-to-all is a permutation of the data over the group, so its gradient is the
inverse all-to-all (`_AllToAll`); gloo, NCCL and the CPU tests run the same
``dist.all_to_all_single``. Per call a rank sends and receives ``(cp-1)/cp`` of its q,
k, v and output (annot.memory's communication model counts it) and never holds more
than ``heads/cp`` heads of the whole sequence.

Head counts must divide: query heads by cp (refused, naming the counts and the
module); key/value heads fewer than cp or not dividing (grouped-query attention with
few key/value heads) are repeated to the query heads first, which costs traffic but is
exact. Masks, cross attention and KV caches are refused as in `split_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from annot.runtime.split_attention import AttentionNotSplittableError, refuse_unsplittable_call

#: The function Ulysses attention calls on the whole sequence, as torch defines it
#: (bound at import, before any `SplitAttention` replaces the attribute).
_SDPA = F.scaled_dot_product_attention

__all__ = ["checked_heads", "heads_to_sequence", "refuse_head_counts", "sequence_to_heads",
           "ulysses_attention", "whole_sequence_sdpa"]


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H, t, D)`` on each rank -> ``(B, H/cp, cp*t, D)``: head group ``r`` of
    every rank's part, parts in rank order (no autograd)."""
    size = dist.get_world_size(group)
    b, h, t, d = x.shape
    # (cp, B, H/cp, t, D): block j goes to rank j
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # block i came from rank i: its part of the sequence
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`: ``(B, H/cp, cp*t, D)`` -> ``(B, H, t, D)``."""
    size = dist.get_world_size(group)
    b, hs, length, d = x.shape
    t = length // size
    # (cp, B, H/cp, t, D): part j of the sequence goes back to rank j
    send = x.reshape(b, hs, size, t, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # block i is head group i
    return received.transpose(0, 1).reshape(b, size * hs, t, d)


class _AllToAll(torch.autograd.Function):
    """One of the two exchanges; its gradient is the other (they are inverse permutations)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, to_sequence: bool) -> torch.Tensor:
        ctx.group, ctx.to_sequence = group, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        inverse = _sequence_to_heads if ctx.to_sequence else _heads_to_sequence
        return inverse(grad.contiguous(), ctx.group), None, None


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H, t, D)`` (this rank's part, every head) -> ``(B, H/cp, cp*t, D)`` (every
    rank's part in rank order, this rank's heads), with autograd."""
    out: torch.Tensor = _AllToAll.apply(x, group, True)
    return out


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `heads_to_sequence`, with autograd."""
    out: torch.Tensor = _AllToAll.apply(x, group, False)
    return out


def refuse_head_counts(query_heads: int, cp: int, where: str = "attention") -> None:
    """Refuse ``query_heads`` that do not divide over ``cp`` ranks (names ``where``)."""
    if query_heads % cp:
        raise AttentionNotSplittableError(
            f"{where} has {query_heads} query heads, which do not divide over cp {cp}: Ulysses "
            f"attention gives each cp rank heads/cp heads. Choose cp among the divisors of "
            f"{query_heads}, or cp_attention='allgather' (any head count)")


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, group: dist.ProcessGroup,
                      query_places: torch.Tensor, key_places: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this rank's part of the sequence, computed by
    heads over the whole sequence (module docstring). ``query_places``: this rank's
    tokens' places; ``key_places``: every rank's, in rank order."""
    key, value = checked_heads(query, key, value, attn_mask, group=group, query_places=query_places)
    # A head group of the queries pairs with the same group of the kv heads: rank r gets
    # query heads [r*H/cp, (r+1)*H/cp) and kv heads [r*Hkv/cp, ...), the ones they use.
    q, k, v = (heads_to_sequence(t, group) for t in (query, key, value))
    out = whole_sequence_sdpa(q, k, v, key_places, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    return sequence_to_heads(out, group)


def checked_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None, *, group: dist.ProcessGroup,
                  query_places: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value a Ulysses exchange over ``group`` can split, ``(B, H, t, D)``
    tensors: a call Ulysses cannot split, or query heads that do not divide, refused;
    grouped-query key/value heads that do not divide repeated to the query heads (SDPA's
    ``enable_gqa`` pairs query head h with kv head h // (heads / kv_heads), which
    ``repeat_interleave`` reproduces)."""
    refuse_unsplittable_call(query, key, attn_mask, query_places.numel())
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    refuse_head_counts(heads, size)
    if kv_heads != heads and kv_heads % size:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    return key, value


def whole_sequence_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_places: torch.Tensor,
                        *, dropout_p: float, is_causal: bool, scale: float | None,
                        enable_gqa: bool) -> torch.Tensor:
    """SDPA over the whole sequence of some heads, ``(B, h, S, D)`` with the ranks' parts
    one after the other (``key_places``: their places, in that order): put into true
    order, so causal SDPA is exact, and the result back into rank order."""
    order = torch.argsort(key_places).to(q.device)  # rank order -> true order
    q, k, v = (t.index_select(-2, order) for t in (q, k, v))
    out = _SDPA(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa or k.shape[1] != q.shape[1])
    return out.index_select(-2, key_places.to(q.device))  # true order -> rank order
