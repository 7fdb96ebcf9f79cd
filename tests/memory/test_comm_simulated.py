"""Collective bytes per rank at world size 64 (8 nodes x 8), simulated in one process
with torch's fake process group and fake tensors on a Llama-2-7B shape (4 of its 32
layers: every layer sends the same), equal to the planner's prediction within 1%:
FSDP2 over all ranks, HSDP 8 x 8, and TP 8 x FSDP2 8 (examples/bench_comm.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from examples.bench_comm import LAYOUTS, compare  # noqa: E402

EXPECTED = {
    "fsdp2": {("all-gather", "shard"), ("reduce-scatter", "shard")},
    "hsdp": {("all-gather", "shard"), ("reduce-scatter", "shard"), ("all-reduce", "replicate")},
    "tp-fsdp2": {("all-gather", "shard"), ("reduce-scatter", "shard"), ("all-reduce", "tp")},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_collective_bytes_at_world_64_match_the_planner(layout):
    rows = compare(layout, layers=4)
    assert {(op, dim) for op, dim, _, _ in rows} == EXPECTED[layout]
    for op, dim, simulated, predicted in rows:
        assert simulated > 2**20, (op, dim)  # a real 7B-shaped step, not an empty one
        assert abs(predicted / simulated - 1) <= 0.01, (layout, op, dim, simulated, predicted)
