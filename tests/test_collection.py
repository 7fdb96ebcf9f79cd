"""Collection does not depend on which test files are collected together: every test file
collects alone, and so do a few random subsets of files (and the set that once failed).

Each subset is collected by its own ``python -m pytest --collect-only -q`` subprocess.
Collecting every file alone in a fresh process would take a few seconds per file, so one
subprocess (`_ALONE`, running alongside the subsets) collects the files one after another in-process, forgetting
between files every module imported from tests/ (and every conftest) and restoring
``sys.path``: what a
file finds importable is then what a fresh process would give it. The library and
third-party modules (annot, torch, transformers, ...) stay imported, to keep it fast.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "tests").rglob("test_*.py")
    if "golden" not in p.parts
)
SEED = 20261123
SUBSETS = [
    # The set from the issue: a bare 'from conftest import' resolved to the wrong conftest.
    ["tests/huggingface/test_plans.py", "tests/engines/test_fsdp1_policies.py",
     "tests/huggingface/test_from_pretrained.py"],
    *(sorted(random.Random(SEED + i).sample(FILES, 3)) for i in range(5)),
]
COLLECT = ["--collect-only", "-q", "-p", "no:cacheprovider"]
# In the one process that collects file after file: not the plugin whose every session
# ends with gc.collect() runs (over half a second each, with torch and transformers loaded).
ALONE_OPTIONS = [*COLLECT, "-p", "no:unraisableexception"]
TIMEOUT_S = 300

_ALONE = r"""
import contextlib, io, json, sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (kept imported: third-party, and slow to import)

tests = str(Path.cwd().resolve() / "tests")
collect, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
path0, modules0 = list(sys.path), set(sys.modules)


def ours(module):
    file = getattr(module, "__file__", None) or ""
    return file.startswith(tests) or "conftest" in getattr(module, "__name__", "")


class Count:
    n = 0

    def pytest_collection_finish(self, session):
        self.n = len(session.items)


for file in files:
    for name in [m for m in sys.modules if m not in modules0 and ours(sys.modules[m])]:
        del sys.modules[name]
    sys.path[:] = path0
    count, out = Count(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main([*collect, file], plugins=[count])
    print(json.dumps({"file": file, "exit": int(code), "tests": count.n,
                      "output": out.getvalue()[-3000:]}), flush=True)
"""


@pytest.fixture(scope="module")
def alone() -> Iterator[subprocess.Popen[str]]:
    """The collection of every file alone, started at once: it runs while the subsets
    are collected (two processes, two cores) and `test_every_file_collects_alone`, last
    in this file, reads it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _ALONE, json.dumps(ALONE_OPTIONS), json.dumps(FILES)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_files_are_listed():
    assert len(FILES) > 30 and "tests/test_collection.py" in FILES


@pytest.mark.parametrize("files", SUBSETS, ids=[f"subset{i}" for i in range(len(SUBSETS))])
def test_subset_collects_together(alone, files):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *COLLECT, *files],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    tests = [line for line in proc.stdout.splitlines() if "::" in line]
    assert proc.returncode == 0 and tests, (
        f"collecting {' '.join(files)} (seed {SEED}): exit {proc.returncode}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")


def test_every_file_collects_alone(alone):
    out, err = alone.communicate(timeout=TIMEOUT_S)
    assert alone.returncode == 0, err[-3000:]
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["file"] for r in results] == FILES, err[-3000:]
    failed = [r for r in results if r["exit"] != 0 or r["tests"] == 0]
    assert not failed, "\n\n".join(
        f"{r['file']} alone: exit {r['exit']}, {r['tests']} tests\n{r['output']}" for r in failed)
