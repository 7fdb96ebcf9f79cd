"""The HuggingFace Trainer with annot's DeepSpeed config and checkpointing, for real on 2
CPU ranks: every step's loss (mean over the ranks) equals one process on the same rows
(fp32, 1e-6), with each decoder layer recomputed once per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.requires import installed

pytestmark = installed("transformers", "deepspeed", "accelerate")
WORKER = Path(__file__).with_name("hf_worker.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_trainer_with_annots_deepspeed_config_matches_one_process(tmp_path):
    out = tmp_path / "out.pt"
    torchrun(WORKER, str(out), "2", timeout=300)
    run = torch.load(out)
    assert run["config"]["train_micro_batch_size_per_gpu"] == "auto"
    assert run["checkpointed"] == ["model.layers.0", "model.layers.1"]
    assert run["mlp_calls_per_layer_step"] == 2
    assert len(run["losses"]) == 3
    diffs = [abs(a - b) for a, b in zip(run["losses"], run["reference"], strict=True)]
    assert max(diffs) < 1e-6, (run["losses"], run["reference"])
