"""Rewritten models compute the same loss and gradients as the originals (CPU).

`numerics_check.py` runs in a subprocess per target (DeepSpeed keeps module-level state
and takes seconds to import); the fixtures cache its JSON for the tests below.
Models: examples/gpt/model.py (marked blocks, dropout on), the installed transformers
Llama and GPT-2 (trunk selection, KV cache on and off), a fixture with the other call
shapes (1-tuple results, colliding keyword tensors, ...), the issue-15 shapes (ModuleDict
trunk sharing a rotary table and a mask, unpacked pairs, loops outside `forward`,
experts inside blocks, a block whose inputs need no grad), and two public model files
as published (tests/rewriter/data: nanoGPT, vit-pytorch). A third run configures
DeepSpeed's `partition_activations` and `cpu_checkpointing` first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three subprocesses, DeepSpeed's import and all models' runs

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests.rewriter.numerics_check"
MODELS = [
    "gpt",
    "llama",
    "shapes",
    "posbias",
    "shapes15",
    "shapes15_nodrop",
    "nanogpt",
    "nanogpt_nodrop",
    "vit",
    "llama_cache",
    "llama_nocache",
    "gpt2_cache",
    "gpt2_nocache",
]
PARTITIONED = ["shapes15", "nanogpt", "llama", "posbias"]
RUNS = {"deepspeed": ["--target", "deepspeed"], "torch": ["--target", "torch"],
        "partition": ["--target", "deepspeed", "--partition"]}
_RUNS: dict[str, subprocess.Popen[str]] = {}
_CACHE: dict[str, dict[str, dict[str, object]]] = {}


def _results(run: str) -> dict[str, dict[str, object]]:
    """All runs start together, then each is read once."""
    pytest.importorskip("deepspeed")
    if not _RUNS:
        for name, args in RUNS.items():
            _RUNS[name] = subprocess.Popen(
                [sys.executable, "-m", SCRIPT, *args],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    if run not in _CACHE:
        out, err = _RUNS[run].communicate(timeout=600)
        assert _RUNS[run].returncode == 0, err[-3000:]
        _CACHE[run] = json.loads(out.strip().splitlines()[-1])
    return _CACHE[run]


def _model(run: str, model: str) -> dict[str, object]:
    r = _results(run)[model]
    if "skipped" in r:
        pytest.skip(str(r["skipped"]))
    return r


CASES = [(t, m) for t in ("deepspeed", "torch") for m in MODELS] + [
    ("partition", m) for m in PARTITIONED
]


@pytest.mark.parametrize(("run", "model"), CASES)
def test_same_loss_in_training(run: str, model: str) -> None:
    assert _model(run, model)["loss_diff"] == 0.0


@pytest.mark.parametrize(("run", "model"), CASES)
def test_same_gradients_for_every_parameter(run: str, model: str) -> None:
    r = _model(run, model)
    assert r["grads_missing"] == []
    assert r["n_grads"] > 0
    assert r["grad_diff"] == 0.0


@pytest.mark.parametrize(("run", "model"), CASES)
def test_state_dict_keys_unchanged(run: str, model: str) -> None:
    assert _model(run, model)["same_state_dict_keys"] is True


@pytest.mark.parametrize(("run", "model"), [c for c in CASES if not c[1].endswith("_cache")])
def test_training_checkpoints_each_layer_and_recomputes_it_once(run: str, model: str) -> None:
    r = _model(run, model)
    assert r["train_calls"] == r["layers"]
    assert r["recomputed"] == r["layers"]


@pytest.mark.parametrize("target", ["deepspeed", "torch"])
@pytest.mark.parametrize("model", ["llama_cache", "gpt2_cache"])
def test_kv_cache_on_runs_blocks_plainly_and_cache_keeps_its_length(
    target: str, model: str
) -> None:
    """transformers' default `use_cache=True` in training: the guard sees the cache and
    calls the block directly; the cache holds each key once (12 positions)."""
    r = _model(target, model)
    assert r["train_calls"] == 0 and r["recomputed"] == 0
    assert r["cache_lengths"] == [12]


@pytest.mark.parametrize(("run", "model"), CASES)
def test_eval_mode_takes_no_checkpoint(run: str, model: str) -> None:
    r = _model(run, model)
    assert r["eval_calls"] == 0
    assert r["eval_loss_diff"] == 0.0


@pytest.mark.parametrize(("run", "model"), CASES)
def test_no_grad_takes_no_checkpoint(run: str, model: str) -> None:
    assert _model(run, model)["no_grad_calls"] == 0


def test_block_whose_inputs_need_no_grad_gets_its_gradients() -> None:
    """x-transformers' shape under the deepspeed target: every PosBlock parameter has the
    original's gradient (DeepSpeed's reentrant checkpoint gave them none)."""
    r = _model("deepspeed", "posbias")
    assert r["n_grads"] == 6 and r["grad_diff"] == 0.0 and r["grads_missing"] == []


def test_partitioning_gets_the_streams_and_only_them() -> None:
    """With partition_activations on, DeepSpeed is handed the per-block stream (and may
    empty it), never the shared rotary table or mask: 3 ModuleDict blocks + 2 position
    blocks stream; the residual pairs (`x = attn(x) + x`) keep a second holder and bind it."""
    assert _model("partition", "shapes15")["streamed"] == 5
    assert _model("partition", "nanogpt")["streamed"] == 3
