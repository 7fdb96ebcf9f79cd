"""Encoder-decoder, speech and masked-LM models on 2 CPU ranks through
`annot.from_pretrained` (issue #42): T5 in bfloat16 with the modules transformers keeps
in float32 (its ``wo``), BERT-MLM with its tied head, Whisper, BART, FSDP2 plain and
checkpointed, against one process in the same precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.huggingface.multimodal_models import INPUTS, OTHERS, compare, prepare, reference, spec

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("multimodal_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("encoder-decoders")
    for name in OTHERS:
        prepare(name, root / name)
    out = root / "results.pt"
    torchrun(WORKER, str(out), str(root), *(f"{n}:{s}" for n in OTHERS for s in ("plain", "checkpoint")),
             timeout=600)
    return root, torch.load(out, weights_only=False)


@pytest.mark.parametrize("scenario", ["plain", "checkpoint"])
@pytest.mark.parametrize("name", list(OTHERS))
def test_fsdp2_step_equals_one_process_in_the_same_precision(runs, name, scenario):
    root, results = runs
    got = results[f"{name}:{scenario}"]
    assert "error" not in got, got.get("traceback", got)
    batches = torch.load(root / name / INPUTS, weights_only=False)["images"]
    dtype = spec(name)[3]
    assert compare(reference(root / name, batches), got, dtype) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_t5_keeps_the_dtypes_transformers_keeps_and_no_unit_mixes_them(tmp_path, dtype):
    """transformers keeps T5's ``wo`` in float32 in float16 (``_keep_in_fp32_modules``),
    not in bfloat16 (no ``_strict`` list): annot's load has transformers' dtypes, and its
    Plan shards float16 T5's ``wo`` apart (FSDP shards one dtype per unit)."""
    import transformers

    import annot
    from tests.huggingface.multimodal_models import build

    build("t5_bf16").to(torch.float32).save_pretrained(tmp_path)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=dtype)
    ours = annot.from_pretrained(tmp_path, engine=None, torch_dtype=dtype)
    assert {n: p.dtype for n, p in ours.named_parameters()} == {n: p.dtype for n, p in theirs.named_parameters()}
    kept = [n for n, p in ours.named_parameters() if p.dtype == torch.float32]
    assert bool(kept) == (dtype == torch.float16) and all(".wo." in n for n in kept)
    assert annot.plan(ours).mixed_dtype_units() == []
