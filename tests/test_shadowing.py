"""A user's own ``policies.py`` and ``rewriter.py`` beside their script do not break annot
(docs/design.md, "The package boundary"): annot imports its parts as ``annot.policies`` and
``annot.rewriter`` only, never by the top-level names a user's files would take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Slow lane: each test starts fresh Python processes that import torch.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

USER_FILE = 'raise ImportError("user file imported: {name}.py beside the script")\n'

SCRIPT = """\
import torch

import annot

print(annot.__file__)
print(annot.Plan, annot.Policy, annot.AnnotError)

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
plan = annot.plan(model, annot.by_class(torch.nn.Linear))
print(plan)
assert [unit.path for unit in plan.units] == ["0", "2"], plan

from annot.rewriter import rewrite_source

result = rewrite_source(open("model.py").read(), target="torch")
assert result.changed and "checkpoint" in result.code, result.code
print("ok")
"""

MODEL = """\
from torch import nn


class Block(nn.Module):
    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x
"""


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    for name in ("policies", "rewriter"):
        (tmp_path / f"{name}.py").write_text(USER_FILE.format(name=name))
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "model.py").write_text(MODEL)
    return tmp_path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_users_policies_and_rewriter_files_do_not_shadow_annot(user_dir: Path) -> None:
    proc = run(["script.py"], user_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # this checkout's annot was the one tested, not another installed copy
    assert Path(proc.stdout.splitlines()[0]).resolve() == REPO / "annot" / "__init__.py"
    assert proc.stdout.splitlines()[-1] == "ok"


def test_annot_rewrite_beside_users_files(user_dir: Path) -> None:
    proc = run(["-m", "annot.cli", "rewrite", "--help"], user_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage: annot rewrite" in proc.stdout

    proc = run(["-m", "annot.cli", "rewrite", "model.py", "--target", "torch", "-q"],
               user_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint" in (user_dir / "model.py").read_text()
