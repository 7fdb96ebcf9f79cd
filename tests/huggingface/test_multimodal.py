"""Vision-language models on 2 CPU ranks with real pixel values (issue #42): FSDP2 through
`annot.from_pretrained`, plain and checkpointed, against one process; rank 0 with images
and rank 1 text only (docs/design.md, pitfall 58: the launch finishes and equals the mean
of one process's two per-batch steps), on FSDP2 and on DeepSpeed ZeRO-3; the vision tower
frozen (its weights unchanged, no optimizer state for them). Llama 4's own forward fails on image batches in
transformers 5.24 (the sweep records it): it is not among these."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.huggingface.multimodal_models import INPUTS, VLMS, compare, prepare, reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("multimodal_worker.py")
SCENARIOS = ("plain", "checkpoint", "mixed", "mixed-zero3", "frozen")
# The default run: one model per way of running the tower beside the language model
# (Qwen's patch grid, LLaVA-OneVision's any-resolution tiles, Idefics3's image
# splitting, Mllama's cross-attention); the sweep lane runs all eight. On ZeRO-3 (slow
# to start on the CPU) the default run takes one of each stand-in: the features method
# with mm_encoder_outputs (Qwen2.5-VL) and the cross-attention one (Mllama).
DEFAULT = ("qwen2_5_vl", "llava_onevision", "idefics3", "mllama")
DEFAULT_ZERO3 = ("qwen2_5_vl", "mllama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> tuple[Path, dict]:
    sweep = "sweep" in (request.config.getoption("markexpr") or "")
    models = [m for m in VLMS if sweep or m in DEFAULT]
    root = tmp_path_factory.mktemp("vlms")
    for model_type in models:
        prepare(model_type, root / model_type)
    out = root / "results.pt"
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    cases = [f"{m}:{s}" for m in models for s in SCENARIOS
             if s != "mixed-zero3" or (deepspeed and (sweep or m in DEFAULT_ZERO3))]
    torchrun(WORKER, str(out), str(root), *cases, timeout=900)
    return root, torch.load(out, weights_only=False)


def _case(runs: tuple[Path, dict], model_type: str, scenario: str) -> tuple[Path, dict]:
    root, results = runs
    if f"{model_type}:{scenario}" not in results:
        pytest.skip(f"{model_type} runs in the sweep lane (python -m pytest -m sweep {__file__})")
    return root / model_type, results[f"{model_type}:{scenario}"]


def _params():
    return [pytest.param(m, marks=() if m in DEFAULT else pytest.mark.sweep) for m in VLMS]


@pytest.mark.parametrize("model_type", _params())
@pytest.mark.parametrize("scenario", ["plain", "checkpoint"])
def test_fsdp2_step_equals_one_process(runs, model_type, scenario):
    directory, got = _case(runs, model_type, scenario)
    assert "error" not in got, got.get("traceback", got)
    batches = torch.load(directory / INPUTS, weights_only=False)["images"]
    assert compare(reference(directory, batches), got) == []
    assert got["stand_ins"] == [0, 0]  # every batch had images: nothing stood in


def _mixed_params():
    return [pytest.param(m, s, marks=() if m in (DEFAULT_ZERO3 if s == "mixed-zero3" else DEFAULT)
                         else pytest.mark.sweep)
            for m in VLMS for s in ("mixed", "mixed-zero3")]


@pytest.mark.parametrize(("model_type", "scenario"), _mixed_params())
def test_a_rank_without_images_finishes_with_the_mean_of_both_steps(runs, model_type, scenario):
    """FSDP2 (checkpointed) and DeepSpeed ZeRO-3, which gathers module by module: the
    ranks with images run their tower at the forward's start too (mm_encoder_outputs)."""
    if scenario == "mixed-zero3":
        pytest.importorskip("deepspeed")
    directory, got = _case(runs, model_type, scenario)
    assert "error" not in got, got.get("traceback", got)
    batches = torch.load(directory / INPUTS, weights_only=False)
    assert compare(reference(directory, [batches["images"][0], batches["text"][1]]), got) == []
    # rank 1 ran the tower at weight zero, once (Mllama: its whole image path)
    assert got["stand_ins"] == [0, 1]


@pytest.mark.parametrize("model_type", _params())
def test_a_frozen_tower_keeps_its_weights_and_gets_no_optimizer_state(runs, model_type):
    directory, got = _case(runs, model_type, "frozen")
    assert "error" not in got, got.get("traceback", got)
    batches = torch.load(directory / INPUTS, weights_only=False)["images"]
    assert compare(reference(directory, batches, frozen=("vision",)), got) == []
    assert got["tower_params"] > 0 and got["tower_unchanged"]
    assert got["tower_state"] == 0 and got["state"] > 0
