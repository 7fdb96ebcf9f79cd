"""examples/gpt/train.py --resume DIR --save-every N: a run stopped after its step-3
save and started again in a new process prints the losses the uninterrupted run did."""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from tests.distributed import ROOT, free_port, run_process, worker_env

pytestmark = pytest.mark.distributed

TRAIN = ROOT / "examples" / "gpt" / "train.py"
ARGS = ["--steps", "6", "--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--batch_size", "2"]


def train(directory, *extra: str) -> str:
    env = {**worker_env(), "MASTER_PORT": str(free_port())}
    proc = run_process([sys.executable, str(TRAIN), *ARGS, "--resume", str(directory), *extra],
                       timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step +(\d+) +loss ([\d.]+)$", out, re.M)}


def test_train_example_resumes_where_it_saved(tmp_path):
    whole = train(tmp_path, "--save-every", "3")  # saves at steps 3 and 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000006"]
    shutil.rmtree(tmp_path / "step-00000006")  # as if it had stopped after step 3's save
    again = train(tmp_path)
    assert "at step 3" in again
    assert losses(again) == {s: v for s, v in losses(whole).items() if s >= 3}
    assert len(losses(again)) == 3
