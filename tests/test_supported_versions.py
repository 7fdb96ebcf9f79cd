"""pyproject.toml states the torch versions annot supports; the torch this suite runs on
must be one of them (a GPU machine may carry another build: this says so first)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import ROOT


def _torch_requirement():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    requirements = pytest.importorskip("packaging.requirements", reason="needs packaging")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_line] = [d for d in dependencies if requirements.Requirement(d).name == "torch"]
    return requirements.Requirement(torch_line)


def test_pyproject_bounds_torch_on_both_sides():
    specifier = _torch_requirement().specifier
    assert {s.operator for s in specifier} >= {">=", "<"}, str(specifier)


def test_the_installed_torch_is_a_supported_one():
    requirement = _torch_requirement()
    installed = torch.__version__.split("+")[0]  # a local build tag (+cpu, +cu128) is not a version bound
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"torch {torch.__version__} is outside pyproject.toml's {requirement}")
