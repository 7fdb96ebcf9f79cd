"""The planner against counted bytes (examples/bench_memory.py): for every strategy
annot builds, with checkpointing and CPU offload, the planner's per-rank figure is within
10% of the peak of live tensor bytes counted in a real 2-rank CPU training run (one
torchrun launch for the default run's rows, one for the sweep lane's). The suite runs the smaller model size (the launch is the
slowest test here); `python examples/bench_memory.py` runs both for the table in docs/guides/memory.md."""

from __future__ import annotations

import pytest

from examples.bench_memory import SIZES, compare, launch

TOLERANCE = 0.10
# The rows the issue asks for: DDP, FSDP2 with and without resharding, FSDP1,
# ZeRO-1/2/3, checkpointing, CPU offload (optimizer only and everything). The default
# run takes one of each engine and each kind of offload (the launch is among the
# suite's slowest); the sweep lane the rest, in a second launch.
ROWS = [
    ("zero3", True), ("zero3-offload", True),
    ("ddp", False), ("fsdp2", False),
    ("fsdp1", True), ("fsdp2-offload", True),
]
MORE_ROWS = [
    ("ddp", True), ("zero1", False), ("zero3", False), ("zero2", False), ("fsdp2-no-reshard", False),
    ("zero2-offload", False), ("zero3-offload-opt", False),
]


def _within_tolerance(tmp_path, rows_asked: list[tuple[str, bool]]) -> dict[tuple[str, bool], dict]:
    """Every row of ``rows_asked`` within `TOLERANCE` of its count; the rows by (strategy,
    checkpointing)."""
    sizes = list(SIZES)[:1]
    rows = compare(launch(tmp_path / "out.pt", sizes, rows_asked, timeout=600))
    assert len(rows) == len(rows_asked) * len(sizes)
    off = [f"{r['size']} {r['strategy']}{' +ckpt' if r['checkpoint'] else ''}: measured "
           f"{r['measured']} B, planner {r['predicted']} B ({r['error']:+.1%})"
           for r in rows if abs(r["error"]) > TOLERANCE]
    assert not off, "\n".join(off)
    return {(r["strategy"], r["checkpoint"]): r for r in rows}


@pytest.mark.distributed
@pytest.mark.slow
def test_the_planner_is_within_ten_percent_of_counted_peaks(tmp_path):
    rows = _within_tolerance(tmp_path, ROWS)
    # Checkpointed, FSDP2 holds a unit more than FSDP1 in backward: its reduce-scatter
    # input, kept through the next unit's backward and recomputation (docs/design.md,
    # pitfall 72). Measured: 3.0 MiB counted, 3.0 MiB planned; the planner said 0 before.
    fsdp2, fsdp1 = rows[("fsdp2-offload", True)], rows[("fsdp1", True)]  # one memory on a CPU
    counted, planned = fsdp2["measured"] - fsdp1["measured"], fsdp2["predicted"] - fsdp1["predicted"]
    assert counted > 0 and abs(planned / counted - 1) <= TOLERANCE, (counted, planned)


@pytest.mark.distributed
@pytest.mark.sweep
def test_the_other_rows_are_within_ten_percent_too(tmp_path):
    _within_tolerance(tmp_path, MORE_ROWS)
