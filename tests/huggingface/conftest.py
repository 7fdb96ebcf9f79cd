"""Fixtures shared by the HuggingFace tests: the architecture matrix, saved checkpoints,
and one torchrun launch for the whole matrix with both engines (launches are the slow part)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.huggingface.hf_archs import (
    ARCHS,
    LAUNCH_TIMEOUT_S,
    PRETRAINED_DISTRIBUTED,
    PlantedPickle,
    planted_sentinel,
)

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("hf_worker.py")


class SavedModels(dict):
    """Architecture name -> its directory, saved on first use (a session that runs a few
    architectures imports and saves only those)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        import pickle

        directory = self.root / name
        ARCHS[name].build().save_pretrained(directory)
        (directory / ".metadata").write_bytes(pickle.dumps(PlantedPickle(planted_sentinel(self))))
        self[name] = directory
        return directory


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory) -> SavedModels:
    """Each architecture from the shared seed, saved with ``save_pretrained`` when first
    asked for, with a planted ``.metadata`` beside it (`PlantedPickle`; sentinel:
    `planted_sentinel`)."""
    return SavedModels(tmp_path_factory.mktemp("pretrained"))


ENGINE_FIXTURES = {"fsdp2": "fsdp2_run", "deepspeed": "zero3_run"}


def _launch(engines: list[str], tmp_path_factory, saved_models) -> dict[str, dict]:
    """One launch for the engines in turn: the whole matrix trained on 2 ranks, and
    from_pretrained on 2 ranks (FSDP2: four architectures; ZeRO-3: llama)."""
    pretrained = {"fsdp2": [saved_models[n] for n in PRETRAINED_DISTRIBUTED],
                  "deepspeed": [saved_models["llama"]]}
    out = tmp_path_factory.mktemp("hf-" + "-".join(engines)) / "results.pt"
    args = [str(out)]
    for engine in engines:
        args += ["--engine", engine, *ARCHS, "--pretrained", *map(str, pretrained[engine])]
    result = torchrun(WORKER, *args, timeout=LAUNCH_TIMEOUT_S * len(engines))
    assert result.returncode == 0, result.stdout[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="session")
def hf_runs(request, tmp_path_factory, saved_models) -> dict[str, dict]:
    """The runs of the engines the session's selected tests read (DeepSpeed only where
    installed), FSDP2 first, all in one launch; an engine not launched then is launched
    on its own when asked for (see `_engine_run`)."""
    used = {name for item in request.session.items for name in item.fixturenames}
    engines = [e for e, fixture in ENGINE_FIXTURES.items() if fixture in used]
    if importlib.util.find_spec("deepspeed") is None and "deepspeed" in engines:
        engines.remove("deepspeed")
    return _launch(engines, tmp_path_factory, saved_models) if engines else {}


def _engine_run(engine: str, hf_runs: dict, tmp_path_factory, saved_models) -> dict:
    if engine not in hf_runs:
        hf_runs.update(_launch([engine], tmp_path_factory, saved_models))
    return hf_runs[engine]


@pytest.fixture(scope="session")
def fsdp2_run(hf_runs, tmp_path_factory, saved_models) -> dict:
    """The whole matrix trained with FSDP2 on 2 ranks, plus 2-rank from_pretrained."""
    return _engine_run("fsdp2", hf_runs, tmp_path_factory, saved_models)


@pytest.fixture(scope="session")
def zero3_run(hf_runs, tmp_path_factory, saved_models) -> dict:
    """The whole matrix trained with DeepSpeed ZeRO-3 on 2 ranks, plus one from_pretrained."""
    pytest.importorskip("deepspeed")
    return _engine_run("deepspeed", hf_runs, tmp_path_factory, saved_models)
