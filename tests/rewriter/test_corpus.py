"""Robustness over transformers' modeling files (a fixed sample; the full corpus is run by
``examples/bench_rewrite.py --verify``): no crash, every output parses, a second run
changes nothing, undo gives the bytes back, files without a site stay byte-identical,
and every wrapped call passing KV-cache state tests the cache in its guard."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from annot.rewriter import rewrite_source, undo_source
from examples.bench_rewrite import kv_guards

# About a second a file, 40 files: together too long for the fast lane.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
FILES = sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))
# Every 20th file of at most 60 kB: the shapes vary across models, the size adds only time.
SAMPLE = [p for p in FILES if p.stat().st_size <= 60_000][::20]


@pytest.mark.parametrize("path", SAMPLE, ids=lambda p: p.name)
def test_corpus_file(path: Path, target: str) -> None:
    source = path.read_text(encoding="utf-8")
    result = rewrite_source(source, target=target)
    if not result.changed:
        assert result.code == source
        return
    _, unguarded = kv_guards(cst.parse_module(result.code))
    assert unguarded == 0
    assert rewrite_source(result.code, target=target).code == result.code
    assert undo_source(result.code).code == source
