"""The import contract of docs/design.md, checked by ``.ci/check_imports.py``: no import
cycles, the package direction and the layer table kept. The checker itself is tested on
small synthetic packages written to a temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECKER = REPO / ".ci" / "check_imports.py"


def run_checker(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), str(root)],
                          capture_output=True, text=True, timeout=60)


def test_annot_keeps_the_import_contract() -> None:
    proc = run_checker(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# A small package shaped like annot: policies/ and rewriter/ beside it, linked in.
CLEAN = {
    "annot/__init__.py": "from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from annot.wrap import auto_wrap\n"
                         "_EXPORTS = {'plan': 'policies'}\n",
    "annot/errors.py": "from annot.policies.errors import AnnotError\n",
    "annot/planning.py": "from annot.policies import Plan\n",
    "annot/meta/__init__.py": "",
    "annot/meta/deferred.py": "import torch\nfrom ..errors import AnnotError\n",
    "annot/runtime/__init__.py": "",
    "annot/runtime/units.py": "from annot.meta import deferred\n",
    "annot/engines/__init__.py": "",
    "annot/engines/fsdp2.py": "import torch.distributed.fsdp\nfrom . import checks\n"
                              "from annot.runtime.units import x\n",
    "annot/engines/checks.py": "def f():\n    import deepspeed\n",
    "annot/engines/registry.py": "def get_engine():\n    from annot.engines.fsdp2 import FSDP2\n",
    "annot/wrap.py": "from annot.engines import registry\nfrom annot.planning import plan\n",
    "annot/cli/__init__.py": "",
    "annot/cli/main.py": "def main():\n    from annot.rewriter.cli import main\n",
    "policies/__init__.py": "from annot.policies.plan import Plan\n",
    "policies/errors.py": "class AnnotError(Exception):\n    pass\n",
    "policies/plan.py": "from torch import nn\nfrom .errors import AnnotError\n",
    "rewriter/__init__.py": "",
    "rewriter/cli.py": "import argparse, os.path\n\ndef main():\n    import libcst\n"
                        "    from .codemod import rewrite_source\n",
    "rewriter/codemod.py": "from __future__ import annotations\nimport libcst as cst\n",
}


def make_package(tmp_path: Path, extra: dict[str, str] | None = None) -> Path:
    root = write(tmp_path / "repo", CLEAN | (extra or {}))
    for name in ("policies", "rewriter"):
        try:
            os.symlink(Path("..") / name, root / "annot" / name)
        except OSError:
            pytest.skip("symbolic links unavailable")
    return root


def test_clean_package_passes(tmp_path: Path) -> None:
    proc = run_checker(make_package(tmp_path))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines()[-1] == (
        "cycles: 0, direction violations: 0, engine internals outside engines: 0, "
        "engine modules outside their engine: 0")


def test_planted_cycle_is_reported_with_its_edges(tmp_path: Path) -> None:
    # meta and runtime share a layer, so only the cycle is wrong here; the import of
    # runtime is inside a function and still counts
    root = make_package(tmp_path, {
        "annot/meta/deferred.py": "def f():\n    from annot.runtime.units import unit_paths\n",
    })
    proc = run_checker(root)
    assert proc.returncode == 1
    out = proc.stdout
    assert "cycle 1 (2 modules): annot.meta.deferred, annot.runtime.units" in out
    assert "annot.meta.deferred -> annot.runtime.units" in out
    assert "annot.runtime.units -> annot.meta.deferred" in out
    assert out.splitlines()[-1].startswith("cycles: 1, direction violations: 0,")


def test_cycle_through_a_package_init(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/meta/__init__.py": "from annot.meta.deferred import build\n",
        "annot/meta/deferred.py": "from annot.meta import materialization\n",
        "annot/meta/materialization.py": "from annot import meta\n",
    })
    proc = run_checker(root)
    assert "(3 modules): annot.meta, annot.meta.deferred, annot.meta.materialization" in (
        proc.stdout)


def test_planted_policies_violation_under_type_checking(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "policies/plan.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from torch.distributed import DeviceMesh\n"
                            "    from annot.engines.fsdp2 import x\n",
    })
    proc = run_checker(root)
    assert proc.returncode == 1
    out = proc.stdout
    # named by the link, not by the folder it points to
    assert "annot/policies/plan.py:3: policies imports torch.distributed" in out
    assert "annot/policies/plan.py:4: policies imports annot.engines.fsdp2" in out
    # the second is also a generic module importing an engine's module
    assert out.splitlines()[-1] == (
        "cycles: 0, direction violations: 2, engine internals outside engines: 0, "
        "engine modules outside their engine: 1")


def test_rewriter_may_import_stdlib_and_libcst_only(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "rewriter/codemod.py": "import libcst\nimport json\nimport torch\n"
                               "from annot.policies import Plan\n",
    })
    out = run_checker(root).stdout
    assert "rewriter imports torch:" in out
    assert "rewriter imports annot.policies:" in out
    assert "rewriter imports json" not in out and "rewriter imports libcst" not in out


def test_lower_layer_importing_higher_one_and_old_names(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/engines/checks.py": "def f():\n    from ..wrap import resolve_plan\n",
        "annot/planning.py": "import policies\n",
    })
    out = run_checker(root).stdout
    assert ("annot/engines/checks.py:2: annot.engines.checks (engines) imports annot.wrap "
            "(wrap, values): a lower layer imports a higher one") in out
    assert "annot/planning.py:1: annot.planning imports the old top-level name policies" in out


def test_engine_internals_outside_engines(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/meta/deferred.py": "def f():\n    import deepspeed.comm\n"
                                  "    from torch.distributed import fsdp\n",
    })
    proc = run_checker(root)
    assert proc.returncode == 1
    out = proc.stdout
    assert "annot/meta/deferred.py:2: annot.meta.deferred imports deepspeed.comm" in out
    assert "annot/meta/deferred.py:3: annot.meta.deferred imports torch.distributed" in out
    assert out.splitlines()[-1] == (
        "cycles: 0, direction violations: 0, engine internals outside engines: 2, "
        "engine modules outside their engine: 0")


def test_module_missing_from_the_layer_table(tmp_path: Path) -> None:
    out = run_checker(make_package(tmp_path, {"annot/extra.py": ""})).stdout
    assert "annot.extra has no layer" in out


def copy_of_annot(tmp_path: Path) -> Path:
    """annot's own source (annot/, policies/, rewriter/, the links kept) in a scratch folder."""
    root = tmp_path / "copy"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("annot", "policies", "rewriter"):
        shutil.copytree(REPO / name, root / name, symlinks=True, ignore=skip)
    return root


@pytest.mark.slow  # two checker runs over the whole package: about 2.5 s
def test_generic_module_importing_an_engine_module_is_rejected(tmp_path: Path) -> None:
    root = copy_of_annot(tmp_path)
    assert run_checker(root).returncode == 0, "the unmodified copy must pass"
    values = root / "annot" / "values.py"
    values.write_text(values.read_text()
                      + "\nfrom annot.engines.deepspeed import refresh_secondary_partitions\n")
    proc = run_checker(root)
    assert proc.returncode == 1
    assert ("annot.values imports annot.engines.deepspeed, a module of engine deepspeed: "
            "generic modules ask the engine contract") in proc.stdout
    assert proc.stdout.splitlines()[-1].endswith("engine modules outside their engine: 1")


@pytest.mark.slow  # four checker runs over the whole package: about 5 s
def test_checkpoint_io_importing_a_format_package_is_rejected(tmp_path: Path) -> None:
    """The generic loader and saver learn a checkpoint's format from data
    (`CheckpointFormat`): an import of annot.huggingface, of an adapter of annot.formats
    (diffusers'), or of a format's library is refused, even inside a function."""
    root = copy_of_annot(tmp_path)
    assert run_checker(root).returncode == 0, "the unmodified copy must pass"
    loading = root / "annot" / "checkpoint_io" / "loading.py"
    original = loading.read_text()
    for planted, named in (("from annot.huggingface.model import is_peft_model\n", "annot.huggingface.model"),
                           ("def _f():\n    from annot.formats.diffusers import DIFFUSERS\n",
                            "annot.formats.diffusers"),
                           ("def _f():\n    import diffusers\n", "diffusers")):
        loading.write_text(original + "\n" + planted)
        proc = run_checker(root)
        assert proc.returncode == 1, planted
        assert f"checkpoint_io imports {named}: the generic loader and saver import no format " \
            "package" in proc.stdout, proc.stdout
        assert "direction violations: 1," in proc.stdout.splitlines()[-1]


def test_an_engine_module_importing_another_engine_is_rejected(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/engines/fsdp1.py": "from annot.engines.fsdp2 import x\n",
    })
    out = run_checker(root).stdout
    assert ("annot.engines.fsdp1 (fsdp1) imports annot.engines.fsdp2, a module of engine "
            "fsdp2: an engine's modules import only their own engine's") in out


def test_an_engine_imports_its_own_parts(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/engines/fsdp2_state.py": "from annot.engines.checks import f\n",
        "annot/engines/fsdp2.py": "import torch.distributed.fsdp\nfrom . import fsdp2_state\n",
    })
    proc = run_checker(root)
    assert proc.returncode == 0, proc.stdout


def test_a_part_named_after_an_engine_is_that_engines(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "annot/engines/fsdp2_state.py": "",
        "annot/engines/layout.py": "from annot.engines import fsdp2_state\n",
    })
    out = run_checker(root).stdout
    assert "annot.engines.layout imports annot.engines.fsdp2_state, a module of engine fsdp2" in out
