"""`examples/benchmark.py` runs: its table driver launches torchrun (one process) for one tiny row and
prints a filled row (no timings asserted: those are for comparing, not testing)."""

from __future__ import annotations

import sys

import pytest

from tests.distributed import ROOT, run_process, worker_env

# A benchmark script's smoke run (about 15 s): in the sweep lane, with the other benchmark
# launches, so the default lane stays under 20 minutes.
pytestmark = [pytest.mark.distributed, pytest.mark.sweep]


def test_the_table_driver_prints_a_filled_row_for_ddp_with_activation_offload():
    cmd = [sys.executable, "examples/benchmark.py", "--table", "--nproc", "1",
           "--strategies", "ddp", "--variants", "offload", "--n_layer", "1", "--n_head", "2",
           "--n_embd", "32", "--block_size", "16", "--vocab_size", "64", "--steps", "1"]
    # A new session: a hang kills the script and the torchrun it started.
    proc = run_process(cmd, cwd=ROOT, env=worker_env(), timeout=180, merge_stderr=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ddp | offload |")]
    assert len(rows) == 1, proc.stdout
    step_s, tokens_per_s, peak_mib, loss = (cell.strip() for cell in rows[0].split("|")[3:7])
    assert float(step_s) > 0 and float(tokens_per_s.replace(",", "")) > 0
    assert float(peak_mib.replace(",", "")) > 0 and float(loss) > 0
    assert "1 processes on cpu, fp32, batch 4 x 16 tokens per rank, 1 timed steps" in proc.stdout
