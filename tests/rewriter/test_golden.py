"""Golden before/after pairs: ``golden/NAME.py`` -> ``golden/NAME.TARGET.expected``.

One pair per call shape and target. Regenerate an expected file only after reading the
diff: it is the contract of what annot writes into users' models.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from annot.rewriter import marked_classes, rewrite_source, undo_source

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.py"))


def _pair(case: str, target: str) -> tuple[str, str]:
    before = (GOLDEN / f"{case}.py").read_text(encoding="utf-8")
    after = (GOLDEN / f"{case}.{target}.expected").read_text(encoding="utf-8")
    return before, after


def _rewrite(source: str, target: str) -> str:
    return rewrite_source(source, target=target, blocks=marked_classes(source) or None).code


@pytest.mark.parametrize("case", CASES)
def test_rewrite_matches_golden(case: str, target: str) -> None:
    before, after = _pair(case, target)
    assert _rewrite(before, target) == after


@pytest.mark.parametrize("case", CASES)
def test_second_run_is_a_no_op(case: str, target: str) -> None:
    _, after = _pair(case, target)
    assert _rewrite(after, target) == after


@pytest.mark.parametrize("case", CASES)
def test_undo_gives_back_the_original(case: str, target: str) -> None:
    before, after = _pair(case, target)
    assert undo_source(after).code == before


@pytest.mark.parametrize("case", CASES)
def test_rewritten_code_compiles(case: str, target: str) -> None:
    _, after = _pair(case, target)
    compile(after, f"{case}.{target}", "exec")
