"""examples/bench_rewrite.py runs end to end (on a few files: its timings are not tested)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_rewrite_prints_its_table_and_counts():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-m", "examples.bench_rewrite", "--limit", "2",
         "--jobs", "1", "2", "--verify"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[0] for row in rows if row and row[0].isdigit()] == ["1", "2"]
    counts = {line.split(":")[0].strip(): int(line.split(":")[1])
              for line in result.stdout.splitlines() if ": " in line and "corpus" not in line}
    assert counts["files"] == 2
    assert counts["crashed"] == counts["output does not parse"] == counts["undo differs"] == 0
    assert counts["KV-cache calls with no cache test"] == 0
