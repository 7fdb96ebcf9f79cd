"""Unit choice on architectures that broke it (issue #29), trained for real on 2 ranks:
the plan's units shard with FSDP2 and give the single-process loss and gradients.

Each rank's loss is the mean over its half of the batch, so the mean over ranks is the
whole batch's mean (equal halves); gradients are FSDP2's averages of the halves. 1e-5
relative on the loss and 1e-5 absolute on gradients: float32 sums in another order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun

pytest.importorskip("transformers")
WORKER = Path(__file__).with_name("unit_choice_worker.py")
ARCHS = ["camembert", "xlm-roberta", "roberta-prelayernorm", "zamba"]


@pytest.mark.distributed
def test_units_of_tied_nested_and_shared_blocks_train_like_one_process(tmp_path):
    out = tmp_path / "results.pt"
    torchrun(WORKER, str(out), *ARCHS, timeout=400)
    results = torch.load(out)
    for arch in ARCHS:
        r = results[arch]
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-5), (arch, r)
        assert r["grad"] <= 1e-5, (arch, r)
