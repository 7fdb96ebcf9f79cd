"""The causal-LM sweep (issue #29), one test per architecture of the installed
transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``annot.from_pretrained(DIR,
"fsdp2")`` on 2 CPU ranks, plain and with ``checkpoint=True``, against plain
single-process ``AutoModelForCausalLM.from_pretrained(DIR)``, and both ``annot plan``
commands (tests/huggingface/sweep_causal_lm.py runs it; the sweep lane: ``-m sweep``).

Each architecture must end as a pass (loss within 1e-5 relative, every gradient within
1e-4 absolute: one fp32 step, sums in another order; both plan commands exit 0), a
refusal by an annot error with its reason, or a skip with its reason (multimodal,
transformers itself fails). A crash, a silent difference or a plan command that fails
on a model that trains fails the test.

``ANNOT_SWEEP_ROWS=FILE`` reads and extends the rows in FILE (e.g. from the script form)
instead of running the whole sweep into a temporary folder.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.huggingface.sweep_causal_lm import causal_lm_types, run_sweep  # noqa: E402
from tests.huggingface.sweep_driver import check_row, sweep_selection  # noqa: E402

ARCHS = causal_lm_types()
TEST_NAME = "test_architecture_passes_or_is_refused_or_skipped_with_its_reason"


@pytest.fixture(scope="module")
def sweep_rows(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # Only the architectures selected (-k), all in one run of the driver.
    selected, out = sweep_selection(request, tmp_path_factory, TEST_NAME, "arch")
    return run_sweep(selected or ARCHS, out)


@pytest.mark.sweep
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_passes_or_is_refused_or_skipped_with_its_reason(sweep_rows, arch):
    """One architecture's row: pass, refused or skipped with the reason, never failing
    (`sweep_driver.check_row`: both scenarios within the bounds, both plan commands 0)."""
    skip = check_row(sweep_rows[arch], ("fsdp2", "fsdp2_checkpoint"), arch)
    if skip:
        pytest.skip(skip)
