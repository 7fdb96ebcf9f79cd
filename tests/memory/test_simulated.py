"""FSDP2 at world size 8 on a 1.31B-parameter GPT, simulated in one process (fake
tensors, torch's fake process group) and measured with torch's FSDPMemTracker: the
planner's per-rank figure is within 10% (examples/bench_memory.py --simulate)."""

from __future__ import annotations

import pytest

from examples.bench_memory import SIMULATED, simulate_fsdp2


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [False, True])
def test_fsdp2_at_world_size_8_matches_fsdpmemtracker(checkpoint):
    measured, planned = simulate_fsdp2(SIMULATED, 8, checkpoint)
    assert measured > 2**30  # a real simulation of a 1.31B model, not an empty one
    assert abs(planned / measured - 1) <= 0.10, (measured, planned)
