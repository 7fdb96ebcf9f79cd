"""The architecture matrix on 2 CPU ranks: 3 training steps with checkpointing on, with
FSDP2 and with DeepSpeed ZeRO-3, match the unwrapped model trained in one process."""

from __future__ import annotations

import pytest

from tests.huggingface.hf_archs import ARCHS, LAYER_COUNT, STEPS, TOLERANCE, reference_losses

pytestmark = pytest.mark.distributed


def _check(run: dict, name: str) -> None:
    result = run["train"][name]
    assert "error" not in result, result.get("error")
    expected = reference_losses(name)
    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(expected, abs=TOLERANCE, rel=TOLERANCE)
    # Checkpointing ran: modules inside every layer ran again during each backward.
    assert result["recomputed"] >= STEPS * LAYER_COUNT[name]
    # Training ran without a cache, and the config keeps the user's setting (for saving).
    assert result["use_cache"] == getattr(ARCHS[name].config(), "use_cache", None)


@pytest.mark.parametrize("name", list(ARCHS))
def test_fsdp2_matches_single_process(fsdp2_run, name):
    _check(fsdp2_run, name)


@pytest.mark.parametrize("name", list(ARCHS))
def test_zero3_matches_single_process(zero3_run, name):
    _check(zero3_run, name)
