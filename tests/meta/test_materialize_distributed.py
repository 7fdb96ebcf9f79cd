"""Sharded materialization on 1, 2 and 4 CPU ranks (FSDP2, gloo): every rank allocates
only its shard, and the full parameters are bitwise those of eager construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.gpt.model import GPT

from ._torchrun import run_torchrun

WORKER = Path(__file__).with_name("fsdp2_materialize_worker.py")
SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)


def _run(ranks: int, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"ranks{ranks}.pt"
    run_torchrun(WORKER, ranks, str(out), *extra)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_world_size_invariant_and_equal_to_eager(ranks, tmp_path):
    got = _run(ranks, tmp_path, "reverse" if ranks == 4 else "forward")
    torch.manual_seed(7)
    eager = GPT(**SHAPE)
    for name, param in eager.named_parameters():
        assert torch.equal(got["params"][name], param), name
    for name, buffer in eager.named_buffers():
        assert torch.equal(got["buffers"][name], buffer), name
    total = sum(p.numel() for p in eager.parameters())
    # Each rank holds about 1/ranks of the parameters (dim-0 shards, rows rounded up).
    assert max(got["local_numel"]) <= total / ranks * 1.1 + 200
