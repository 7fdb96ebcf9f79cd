"""Attention over a sequence split across the ranks of a context-parallel group.

Each rank holds a part of every sequence (`annot.runtime.context_parallel` chooses which
tokens: two chunks, load-balanced for causal masks). Attention is the one operation
that needs the other parts: every query attends to keys and values of the whole
sequence. While `SplitAttention` is active, ``torch.nn.functional.
scaled_dot_product_attention`` is `split_attention` (the attribute is replaced, as torch's
own ``context_parallel`` does by default), in the model's forward and in activation
checkpointing's recomputation during backward:

- the keys and values of every rank are gathered along the sequence
  (`gather_sequence`, an autograd function: forward an all-gather, backward the sum of
  every rank's gradient for this rank's part, an all-reduce and a slice);
- the rank's queries attend to them with a mask built from the tokens' places in the
  whole sequence (query place >= key place for a causal call), so the result is exact:
  the same softmax over the same keys as one process holding the whole sequence.

This is the all-gather form of context parallelism (Llama 3's): each rank holds the
whole sequence's keys and values of one layer at a time, and the scores of its own
queries only (``T/cp x T``). It runs on any backend, gloo included, with plain
``torch.distributed`` collectives. torch's own ``context_parallel``
(``torch.distributed.tensor.experimental``) rewrites SDPA's CUDA kernels
(flash, efficient, cuDNN) and has no CPU path, so it cannot run the CPU tests; this
module keeps the interface the same (the model calls SDPA, nothing else changes).

Why the attribute and not a ``TorchFunctionMode``: a mode is switched off inside its own
handler, and ``Tensor.backward`` is a function it handles, so the whole backward (and
the recomputation in it) ran without the mode: checkpointed blocks recomputed plain
attention over the local chunks (torch's checkpoint caught it: 24 tensors saved in
recomputation against 25 in forward). Code that bound the function before (``from
torch.nn.functional import scaled_dot_product_attention`` at import) calls the original:
the check on the first call refuses such a module by name.

What cannot be split is refused, naming it: an ``attn_mask`` given to SDPA (padding or
custom masks: annot builds the causal mask itself), keys of another length than the
queries (cross attention, a KV cache), and a module called ``*Attention`` whose forward
calls no SDPA (eager attention: a softmax over local scores would be silently wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

#: The function `SplitAttention` stands in for, as torch defines it.
_SDPA = F.scaled_dot_product_attention

__all__ = ["AttentionFunction", "AttentionNotSplittableError", "SplitAttention", "check_attention_modules",
           "gather_sequence", "refuse_unsplittable_call",
           "split_attention"]


class AttentionNotSplittableError(ValueError):
    """A model's attention cannot run on a sequence split over ranks (names the module)."""


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 (the sequence of ``(B, heads, T, head_dim)``), rank order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.length = group, x.shape[-2]
        ctx.rank = dist.get_rank(group)
        x = x.contiguous()  # k and v arrive transposed; collectives take dense tensors
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's queries used this rank's keys: its gradient is the sum over ranks.
        # An all-reduce then a slice (gloo has no reduce-scatter; twice a reduce-scatter's
        # traffic, counted so in annot.memory's communication model).
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(-2, ctx.rank * ctx.length, ctx.length), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim -2, in rank order; its
    gradient flows back to each rank's part."""
    out: torch.Tensor = _GatherSequence.apply(x, group)
    return out


def refuse_unsplittable_call(query: torch.Tensor, key: torch.Tensor,
                             attn_mask: torch.Tensor | None, tokens: int) -> None:
    """Refuse an SDPA call no context-parallel attention can split: one given a mask,
    or whose queries or keys are not this rank's ``tokens`` of the sequence."""
    if attn_mask is not None:
        raise AttentionNotSplittableError(
            "scaled_dot_product_attention got an attn_mask under context parallelism: annot "
            "builds the causal mask from each token's place and cannot split another mask "
            "(padding, a custom pattern). Pad with labels -100 instead of masking, and pass "
            "no attention_mask (or one of all ones)")
    if key.shape[-2] != query.shape[-2] or query.shape[-2] != tokens:
        raise AttentionNotSplittableError(
            f"scaled_dot_product_attention with {query.shape[-2]} queries and {key.shape[-2]} "
            f"keys on a rank holding {tokens} tokens: under context parallelism "
            "only self-attention over the split sequence can be split (no cross attention, no "
            "KV cache: pass use_cache=False)")


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, *, group: dist.ProcessGroup,
                    query_places: torch.Tensor, key_places: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention`` of this rank's queries over the whole sequence.

    ``query_places``: the place in the whole sequence of each of this rank's tokens;
    ``key_places``: the places of the gathered keys (every rank's, in rank order).
    A causal call masks by place, so the result equals unsplit causal attention."""
    refuse_unsplittable_call(query, key, attn_mask, query_places.numel())
    keys, values = gather_sequence(key, group), gather_sequence(value, group)
    mask = None
    if is_causal:
        mask = query_places.to(query.device)[:, None] >= key_places.to(query.device)[None, :]
    return _SDPA(query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                 enable_gqa=enable_gqa)


#: The form of a context-parallel attention function (`split_attention`'s signature).
AttentionFunction = Callable[..., torch.Tensor]


class SplitAttention:
    """A context manager: while active, ``torch.nn.functional.scaled_dot_product_attention``
    is ``function`` (`split_attention`, the default, or
    `annot.runtime.ulysses_attention.ulysses_attention`) over ``group`` with these token
    places (restored on exit, also when nested). ``calls`` counts the calls it replaced;
    ``module`` (set by `AttentionCallCheck` on the first forward) is the attention module
    running, named in a refusal."""

    def __init__(self, group: dist.ProcessGroup, query_places: torch.Tensor,
                 key_places: torch.Tensor, function: AttentionFunction = split_attention) -> None:
        self.group, self.query_places, self.key_places = group, query_places, key_places
        self.function = function
        self.calls = 0
        self.module: str | None = None
        self._before: list[Any] = []

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        try:
            return self.function(query, key, value, *args, **kwargs, group=self.group,
                                 query_places=self.query_places, key_places=self.key_places)
        except AttentionNotSplittableError as error:
            if self.module is None:
                raise
            raise AttentionNotSplittableError(f"module {self.module}: {error}") from error

    def __enter__(self) -> SplitAttention:
        self._before.append(F.scaled_dot_product_attention)
        F.scaled_dot_product_attention = self._attention
        return self

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = self._before.pop()


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose class name ends in "Attention" and that hold no such module."""
    found = [(p, m) for p, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    return [(p, m) for p, m in found
            if not any(q.startswith(p + ".") for q, _ in found if q != p) or p == ""]


def check_attention_modules(model: nn.Module) -> None:
    """Refuse, before anything changes, a model whose attention is known not to call
    SDPA: a transformers model configured with another ``attn_implementation``."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        path, module = next(iter(_attention_modules(model)), ("", model))
        raise AttentionNotSplittableError(
            f"module {path or '(root)'} ({type(module).__name__}) computes attention with "
            f"attn_implementation={impl!r}; context parallelism splits "
            "scaled_dot_product_attention only: load the model with attn_implementation='sdpa'")


class AttentionCallCheck:
    """Hooks on the attention modules (`_attention_modules`) for one forward: each must
    call ``scaled_dot_product_attention`` (counted by ``mode``), else it is refused by
    name, as is a model in which no call was made at all."""

    def __init__(self, model: nn.Module, mode: SplitAttention) -> None:
        self.model, self.mode = model, mode
        self.handles: list[Any] = []
        for path, module in _attention_modules(model):
            self.handles.append(module.register_forward_pre_hook(self._before(path)))
            self.handles.append(module.register_forward_hook(self._after(path)))
        self._start = 0

    def _before(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._start = self.mode.calls
            self.mode.module = f"{path} ({type(module).__name__})"
        return hook

    def _after(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.mode.module = None
            if self.mode.calls == self._start:
                raise AttentionNotSplittableError(
                    f"module {path} ({type(module).__name__}) computed attention without "
                    "scaled_dot_product_attention, so context parallelism cannot split it (its "
                    "scores would cover this rank's part of the sequence only): call "
                    "torch.nn.functional.scaled_dot_product_attention in its forward")
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.mode.module = None
        if self.mode.calls == 0:
            raise AttentionNotSplittableError(
                f"{type(self.model).__name__}'s forward made no scaled_dot_product_attention call: "
                "context parallelism splits SDPA attention only (a hand-written softmax over the "
                "scores would see this rank's part of the sequence only)")
