"""Float8 and compiled blocks on every causal-LM architecture of the installed transformers
(tests/speed/sweep_speed.py): no crash, no difference between compiled and eager, the
state-dict keys unchanged by float8. Sweep lane."""

from __future__ import annotations

import pytest

from tests.requires import installed

pytestmark = [installed("torchao", "transformers"), pytest.mark.sweep]


def test_float8_and_compiled_blocks_on_every_causal_lm_architecture():
    from tests.speed.sweep_speed import causal_lm_types, row, table

    rows = [row(arch) for arch in causal_lm_types()]
    print(table(rows))
    failing = [f"{r['arch']}: {r['reason']}" for r in rows if r["outcome"] == "failing"]
    assert not failing, "\n".join(failing)
    assert sum(r["outcome"] == "pass" for r in rows) >= len(rows) // 2
