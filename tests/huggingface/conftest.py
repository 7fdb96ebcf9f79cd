"""Fixtures shared by the HuggingFace tests: the architecture matrix, saved checkpoints,
and one torchrun launch per engine for the whole matrix (launches are the slow part)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # hf_archs, as the worker imports it

pytest.importorskip("transformers")

from hf_archs import ARCHS  # noqa: E402

# 2-rank from_pretrained checks: one with tied embeddings (gemma), one without (llama),
# one whose file names differ from the model's (gpt_neox), an encoder-decoder (t5).
PRETRAINED_DISTRIBUTED = ("llama", "gemma", "gpt_neox", "t5")
LAUNCH_TIMEOUT_S = 420


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> dict[str, Path]:
    """Each architecture from the shared seed, saved with ``save_pretrained``."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, arch in ARCHS.items():
        arch.build().save_pretrained(root / name)
        out[name] = root / name
    return out


def _launch(engine: str, tmp_path_factory, pretrained: list[Path]) -> dict:
    from tests.engines.engine_harness import torchrun

    out = tmp_path_factory.mktemp(f"hf-{engine}") / "results.pt"
    args = [str(out), engine, *ARCHS]
    if pretrained:
        args += ["--pretrained", *map(str, pretrained)]
    result = torchrun(HERE / "hf_worker.py", *args, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory, saved_models) -> dict:
    """The whole matrix trained with FSDP2 on 2 ranks, plus 2-rank from_pretrained."""
    return _launch("fsdp2", tmp_path_factory, [saved_models[n] for n in PRETRAINED_DISTRIBUTED])


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory, saved_models) -> dict:
    """The whole matrix trained with DeepSpeed ZeRO-3 on 2 ranks, plus one from_pretrained."""
    pytest.importorskip("deepspeed")
    return _launch("deepspeed", tmp_path_factory, [saved_models["llama"]])
