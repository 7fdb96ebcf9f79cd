"""The public surface is a deliberate edit: the names ``annot`` exports are the list
below, and the version is one number in three places (the package, pyproject.toml, the
changelog's newest release)."""

from __future__ import annotations

import re
from pathlib import Path

import annot

ROOT = Path(__file__).resolve().parents[1]

# Adding or removing a public name changes this list, the changelog, and (for a removal)
# goes through a deprecation first (annot._deprecation).
PUBLIC_NAMES = [
    "AnnotError",
    "BudgetAnswer",
    "BudgetError",
    "CheckpointError",
    "CompileOptions",
    "DDPOptions",
    "DeepSpeedOptions",
    "DeferredInitError",
    "DeviceNotAvailableError",
    "EngineNotAvailableError",
    "FSDP1Options",
    "FSDP2Options",
    "Interruptions",
    "MetaDeviceError",
    "OptimizerOrderError",
    "ParallelDims",
    "Plan",
    "PlanError",
    "Policy",
    "PolicySelectionError",
    "PretrainedPathError",
    "ProcessGroupNotInitializedError",
    "ResumableLoader",
    "Trainable",
    "apply_checkpointing",
    "auto_wrap",
    "build",
    "by_class",
    "by_name",
    "by_role",
    "by_size",
    "checkpoint_block",
    "choose_device",
    "deepspeed_config",
    "estimate_memory",
    "every_nth",
    "fit_budget",
    "freeze",
    "from_pretrained",
    "fsdp1_policies",
    "get_mark",
    "init_distributed",
    "latest_state",
    "load",
    "load_state",
    "mark",
    "marked",
    "materialize",
    "meta_init",
    "no_split_modules",
    "offload_block",
    "plan",
    "refresh_float8_scales",
    "register_init",
    "repeated_blocks",
    "resume_state",
    "save",
    "save_state",
    "set_collective_timeout",
    "shard_block",
    "tp_rule",
    "unmark",
]


def test_the_public_names_are_the_checked_list():
    assert sorted(annot.__all__) == PUBLIC_NAMES
    assert len(set(annot.__all__)) == len(annot.__all__), "a name listed twice in __all__"


def test_the_lazy_table_exports_exactly_the_public_names():
    assert sorted(annot._EXPORTS) == PUBLIC_NAMES


def test_the_package_and_pyproject_state_one_version():
    # the first `version =` line is [project]'s (tomllib is 3.11+, annot supports 3.10)
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert found is not None and found.group(1) == annot.__version__


def test_the_changelog_has_an_entry_for_this_version():
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(),
                          flags=re.M)
    assert releases and releases[0] == annot.__version__
