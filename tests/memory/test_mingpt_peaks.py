"""The minGPT table of docs/guides/memory.md ("In your own terms") is what
examples/bench_mingpt_peaks.py predicts: Lightning 1.3's DeepSpeed configs given as
``deepspeed_config=``, DDP without bucket views, against the published peaks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples.bench_mingpt_peaks import PUBLISHED, predictions

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "memory.md"


def _table() -> list[tuple[int, int]]:
    text = GUIDE.read_text().split("Against published peaks", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| [^|]+ \| ([\d,]+) \| ([\d,]+) \|", text, flags=re.M)
    return [(int(p.replace(",", "")), int(q.replace(",", ""))) for p, q in rows]


@pytest.mark.sweep
def test_the_guides_mingpt_table_is_what_the_planner_predicts():
    rows = predictions()
    assert [(published, predicted) for _, published, predicted in rows] == _table()
    assert [published for _, published, _ in rows] == [p for _, p, _, _ in PUBLISHED]
