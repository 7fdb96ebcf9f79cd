"""Ulysses attention (`annot.runtime.ulysses_attention`) against whole causal attention,
its ranks simulated in one process: one thread per cp rank, the all-to-all a mailbox
between barriers (what ``dist.all_to_all_single`` does: block ``j`` of rank ``i``'s input
is block ``i`` of rank ``j``'s output). The real collective runs in the 2-rank launch of
tests/engines/test_context_parallel.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from annot.runtime import ulysses_attention as ua
from annot.runtime.context_parallel import refuse_unsplittable, token_places
from annot.runtime.split_attention import AttentionNotSplittableError, SplitAttention
from tests.engines.context_parallel_cases import build

# fp32; the split changes only the order of float additions (none in the exchange).
TOLERANCE = 1e-5


class _Mailbox:
    """``dist.all_to_all_single`` and ``get_world_size``/``get_rank`` for ``size`` threads."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier = size, threading.Barrier(size)
        self.posted: dict[int, torch.Tensor] = {}
        self.local = threading.local()

    def all_to_all_single(self, output: torch.Tensor, send: torch.Tensor, group: Any = None) -> None:
        rank = self.local.rank
        self.posted[rank] = send.clone()
        self.barrier.wait()
        for source in range(self.size):
            output[source] = self.posted[source][rank]
        self.barrier.wait()  # nobody posts the next exchange before all have read

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = work(rank)
            except BaseException as error:  # noqa: BLE001 (re-raised in the test's thread)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def _simulate(monkeypatch, size: int, heads: int, kv_heads: int, length: int = 16):
    """Outputs and q/k/v gradients of Ulysses over ``size`` simulated ranks, and of whole
    causal SDPA, for ``sum(out**2)``."""
    mailbox = _Mailbox(size)
    monkeypatch.setattr(ua.dist, "all_to_all_single", mailbox.all_to_all_single)
    monkeypatch.setattr(ua.dist, "get_world_size", lambda group=None: size)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, length, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=gen, requires_grad=True) for _ in range(2))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=kv_heads != heads)
    expected = torch.autograd.grad(whole.square().sum(), (q, k, v))
    places = [token_places(length, size, r) for r in range(size)]
    every = torch.cat(places)

    def rank_work(rank: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        local = [t[:, :, places[rank]].detach().requires_grad_() for t in (q, k, v)]
        out = ua.ulysses_attention(*local, is_causal=True, enable_gqa=kv_heads != heads,
                                   group=None, query_places=places[rank], key_places=every)
        return out.detach(), torch.autograd.grad(out.square().sum(), local)

    results = mailbox.run(rank_work)
    out = torch.zeros_like(whole)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank, (part, part_grads) in enumerate(results):
        out[:, :, places[rank]] = part
        for grad, part_grad in zip(grads, part_grads, strict=True):
            grad[:, :, places[rank]] = part_grad
    return (out, grads), (whole.detach(), expected)


def _far(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize(("size", "heads", "kv_heads"),
                         [(2, 4, 4), (4, 4, 4), (2, 4, 2)],
                         ids=["cp2", "cp4", "cp2-gqa"])
def test_ulysses_is_whole_causal_attention(monkeypatch, size, heads, kv_heads):
    (out, grads), (whole, expected) = _simulate(monkeypatch, size, heads, kv_heads)
    assert _far(out, whole) <= TOLERANCE
    assert max(_far(a, b) for a, b in zip(grads, expected, strict=True)) <= TOLERANCE


def test_ulysses_repeats_kv_heads_that_do_not_divide(monkeypatch):
    # 4 query heads share 1 key/value head: cp 2 cannot split it, so it is repeated;
    # its gradient is the sum over the copies.
    (out, grads), (whole, expected) = _simulate(monkeypatch, 2, 4, 1)
    assert _far(out, whole) <= TOLERANCE
    assert max(_far(a, b) for a, b in zip(grads, expected, strict=True)) <= TOLERANCE


def test_query_heads_that_do_not_divide_are_refused_naming_module_and_counts(monkeypatch):
    monkeypatch.setattr(ua.dist, "get_world_size", lambda group=None: 2)
    q = torch.zeros(1, 3, 8, 4)
    places = token_places(16, 2, 0)
    mode = SplitAttention(None, places, torch.arange(16), ua.ulysses_attention)
    mode.module = "model.layers.0.self_attn (LlamaAttention)"
    with mode, pytest.raises(AttentionNotSplittableError,
                             match=r"module model\.layers\.0\.self_attn \(LlamaAttention\): "
                                   r"attention has 3 query heads, which do not divide over cp 2"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_a_config_whose_heads_do_not_divide_is_refused_before_wrapping():
    model = build("llama")  # 4 query heads
    with pytest.raises(AttentionNotSplittableError,
                       match=r"LlamaForCausalLM \(config.num_attention_heads\) has 4 query heads.*cp 8"):
        refuse_unsplittable(model, 8, "ulysses")
    refuse_unsplittable(model, 2, "ulysses")  # divides: accepted


def test_a_minGPT_config_whose_heads_do_not_divide_is_refused_before_wrapping():
    with pytest.raises(AttentionNotSplittableError, match=r"GPT \(config.n_head\) has 2 query heads.*cp 4"):
        refuse_unsplittable(build("gpt"), 4, "ulysses")


def test_an_unknown_cp_attention_is_refused_with_the_choices():
    from annot.engines.fsdp2 import FSDP2Options

    with pytest.raises(ValueError, match=r"cp_attention='ring'.*\['allgather', 'ulysses'\]"):
        FSDP2Options(cp_attention="ring")
