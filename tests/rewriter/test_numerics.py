"""Rewritten models compute the same loss and gradients as the originals (CPU).

`numerics_check.py` runs in a subprocess per target (DeepSpeed keeps module-level state
and takes seconds to import); the fixtures cache its JSON for the tests below.
Models: examples/gpt/model.py (marked blocks, dropout on) and the installed transformers
Llama (trunk selection; relative imports resolved against the installed package), and a
fixture with the other call shapes (1-tuple results, colliding keyword tensors, ...).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two subprocesses, DeepSpeed's import and both models' runs

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests.rewriter.numerics_check"
MODELS = ["gpt", "llama", "shapes"]
TARGETS = ["deepspeed", "torch"]
_RUNS: dict[str, subprocess.Popen[str]] = {}
_CACHE: dict[str, dict[str, dict[str, object]]] = {}


def _results(target: str) -> dict[str, dict[str, object]]:
    """Both targets' subprocesses start together (two cores), then each is read once."""
    if target == "deepspeed":
        pytest.importorskip("deepspeed")
    if not _RUNS:
        for t in TARGETS:
            _RUNS[t] = subprocess.Popen(
                [sys.executable, "-m", SCRIPT, "--target", t],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    if target not in _CACHE:
        out, err = _RUNS[target].communicate(timeout=300)
        assert _RUNS[target].returncode == 0, err[-3000:]
        _CACHE[target] = json.loads(out.strip().splitlines()[-1])
    return _CACHE[target]


@pytest.mark.parametrize("model", MODELS)
def test_same_loss_in_training(target: str, model: str) -> None:
    assert _results(target)[model]["loss_diff"] == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_same_gradients_for_every_parameter(target: str, model: str) -> None:
    r = _results(target)[model]
    assert r["grads_missing"] == []
    assert r["n_grads"] > 0
    assert r["grad_diff"] == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_state_dict_keys_unchanged(target: str, model: str) -> None:
    assert _results(target)[model]["same_state_dict_keys"] is True


@pytest.mark.parametrize("model", MODELS)
def test_training_checkpoints_each_layer(target: str, model: str) -> None:
    r = _results(target)[model]
    assert r["train_calls"] == r["layers"]


@pytest.mark.parametrize("model", MODELS)
def test_eval_mode_takes_no_checkpoint(target: str, model: str) -> None:
    r = _results(target)[model]
    assert r["eval_calls"] == 0
    assert r["eval_loss_diff"] == 0.0


@pytest.mark.parametrize("model", MODELS)
def test_no_grad_takes_no_checkpoint(target: str, model: str) -> None:
    assert _results(target)[model]["no_grad_calls"] == 0
