"""The README's first command: examples/gpt/train.py on 2 processes, loss falling."""

from __future__ import annotations

import re

import pytest

from tests.distributed import ROOT, torchrun

pytestmark = pytest.mark.distributed


def test_train_example_on_two_ranks_prints_the_plan_once_and_the_loss_falls():
    proc = torchrun(ROOT / "examples" / "gpt" / "train.py", "--steps", "10", timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("Plan for GPT") == 1  # rank 0 only
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)$", proc.stdout, re.M)]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 0.5, losses
    assert "fsdp2 on 2 process(es)" in proc.stdout
