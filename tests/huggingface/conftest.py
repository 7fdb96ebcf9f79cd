"""Fixtures shared by the HuggingFace tests: the architecture matrix, saved checkpoints,
and one torchrun launch for the whole matrix with both engines (launches are the slow part)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.huggingface.hf_archs import ARCHS, LAUNCH_TIMEOUT_S, PRETRAINED_DISTRIBUTED

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("hf_worker.py")


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> dict[str, Path]:
    """Each architecture from the shared seed, saved with ``save_pretrained``."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, arch in ARCHS.items():
        arch.build().save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory, saved_models) -> dict[str, dict]:
    """One launch for both engines: the whole matrix trained on 2 ranks with FSDP2, plus
    2-rank from_pretrained; then the same with DeepSpeed ZeRO-3 (one from_pretrained),
    where DeepSpeed is installed."""
    runs = {"fsdp2": [saved_models[n] for n in PRETRAINED_DISTRIBUTED]}
    if importlib.util.find_spec("deepspeed") is not None:
        runs["deepspeed"] = [saved_models["llama"]]
    out = tmp_path_factory.mktemp("hf-runs") / "results.pt"
    args = [str(out)]
    for engine, pretrained in runs.items():
        args += ["--engine", engine, *ARCHS, "--pretrained", *map(str, pretrained)]
    result = torchrun(WORKER, *args, timeout=LAUNCH_TIMEOUT_S * len(runs))
    assert result.returncode == 0, result.stdout[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="session")
def fsdp2_run(hf_runs) -> dict:
    """The whole matrix trained with FSDP2 on 2 ranks, plus 2-rank from_pretrained."""
    return hf_runs["fsdp2"]


@pytest.fixture(scope="session")
def zero3_run(hf_runs) -> dict:
    """The whole matrix trained with DeepSpeed ZeRO-3 on 2 ranks, plus one from_pretrained."""
    pytest.importorskip("deepspeed")
    return hf_runs["deepspeed"]
