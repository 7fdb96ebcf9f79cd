"""annot: shard, checkpoint and offload PyTorch models too large for one GPU.

Mark blocks (or pass a policy), look at the Plan, then apply it to an engine.
Names are loaded on first use (PEP 562), so ``import annot`` and the ``annot rewrite``
command start without importing torch; deepspeed, transformers and safetensors are
imported only inside the functions that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from annot._version import __version__ as __version__

if TYPE_CHECKING:
    from annot.data_loading import ResumableLoader
    from annot.devices import choose_device
    from annot.engines.activation_checkpointing import apply_checkpointing
    from annot.engines.base import Trainable
    from annot.engines.ddp import DDPOptions
    from annot.engines.deepspeed import DeepSpeedOptions
    from annot.engines.deepspeed_config import deepspeed_config
    from annot.engines.fsdp1 import FSDP1Options, fsdp1_policies
    from annot.engines.fsdp2 import FSDP2Options
    from annot.errors import (
        CheckpointError,
        DeviceNotAvailableError,
        EngineNotAvailableError,
        MetaDeviceError,
        OptimizerOrderError,
        PolicySelectionError,
        ProcessGroupNotInitializedError,
    )
    from annot.freezing import freeze
    from annot.huggingface.pretrained import PretrainedPathError, from_pretrained
    from annot.interruptions import Interruptions
    from annot.markers import checkpoint_block, get_mark, mark, offload_block, shard_block, unmark
    from annot.memory import BudgetAnswer, BudgetError, estimate_memory, fit_budget
    from annot.meta.deferred import DeferredInitError, build, meta_init, register_init
    from annot.planning import plan
    from annot.policies import (
        Plan,
        Policy,
        by_class,
        by_name,
        by_role,
        by_size,
        every_nth,
        marked,
        no_split_modules,
        repeated_blocks,
        tp_rule,
    )
    from annot.policies.errors import AnnotError, PlanError
    from annot.policies.parallel import ParallelDims
    from annot.process_group import set_collective_timeout
    from annot.resume import resume_state
    from annot.training_state import latest_state, load_state, save_state
    from annot.values import load, materialize, save
    from annot.wrap import auto_wrap

_EXPORTS = {
    "AnnotError": "annot.policies.errors",
    "PlanError": "annot.policies.errors",
    "Plan": "annot.policies",
    "Policy": "annot.policies",
    "by_class": "annot.policies",
    "by_name": "annot.policies",
    "by_role": "annot.policies",
    "by_size": "annot.policies",
    "CompileOptions": "annot.compiled_blocks",
    "refresh_float8_scales": "annot.float8",
    "every_nth": "annot.policies",
    "marked": "annot.policies",
    "no_split_modules": "annot.policies",
    "repeated_blocks": "annot.policies",
    "tp_rule": "annot.policies",
    "checkpoint_block": "annot.markers",
    "get_mark": "annot.markers",
    "mark": "annot.markers",
    "offload_block": "annot.markers",
    "shard_block": "annot.markers",
    "unmark": "annot.markers",
    "plan": "annot.planning",
    "freeze": "annot.freezing",
    "meta_init": "annot.meta.deferred",
    "build": "annot.meta.deferred",
    "register_init": "annot.meta.deferred",
    "DeferredInitError": "annot.meta.deferred",
    "materialize": "annot.values",
    "load": "annot.values",
    "save": "annot.values",
    "save_state": "annot.training_state",
    "load_state": "annot.training_state",
    "latest_state": "annot.training_state",
    "resume_state": "annot.resume",
    "Interruptions": "annot.interruptions",
    "set_collective_timeout": "annot.process_group",
    "ResumableLoader": "annot.data_loading",
    "Trainable": "annot.engines.base",
    "apply_checkpointing": "annot.engines.activation_checkpointing",
    "FSDP2Options": "annot.engines.fsdp2",
    "FSDP1Options": "annot.engines.fsdp1",
    "DDPOptions": "annot.engines.ddp",
    "DeepSpeedOptions": "annot.engines.deepspeed",
    "CheckpointError": "annot.errors",
    "DeviceNotAvailableError": "annot.errors",
    "choose_device": "annot.devices",
    "from_pretrained": "annot.huggingface.pretrained",
    "PretrainedPathError": "annot.huggingface.pretrained",
    "estimate_memory": "annot.memory",
    "fit_budget": "annot.memory",
    "BudgetAnswer": "annot.memory",
    "BudgetError": "annot.memory",
    "auto_wrap": "annot.wrap",
    "fsdp1_policies": "annot.engines.fsdp1",
    "deepspeed_config": "annot.engines.deepspeed_config",
    "EngineNotAvailableError": "annot.errors",
    "MetaDeviceError": "annot.errors",
    "OptimizerOrderError": "annot.errors",
    "PolicySelectionError": "annot.errors",
    "ProcessGroupNotInitializedError": "annot.errors",
    "init_distributed": "annot.process_group",
    "ParallelDims": "annot.policies.parallel",
}

__all__ = [
    "AnnotError",
    "BudgetAnswer",
    "BudgetError",
    "CheckpointError",
    "DDPOptions",
    "DeepSpeedOptions",
    "DeferredInitError",
    "DeviceNotAvailableError",
    "EngineNotAvailableError",
    "FSDP1Options",
    "FSDP2Options",
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
    "CompileOptions",
    "Trainable",
    "apply_checkpointing",
    "auto_wrap",
    "by_class",
    "by_name",
    "by_role",
    "build",
    "by_size",
    "checkpoint_block",
    "choose_device",
    "deepspeed_config",
    "estimate_memory",
    "every_nth",
    "fit_budget",
    "freeze",
    "fsdp1_policies",
    "from_pretrained",
    "init_distributed",
    "get_mark",
    "latest_state",
    "Interruptions",
    "load",
    "load_state",
    "mark",
    "materialize",
    "meta_init",
    "marked",
    "no_split_modules",
    "offload_block",
    "plan",
    "resume_state",
    "set_collective_timeout",
    "refresh_float8_scales",
    "register_init",
    "repeated_blocks",
    "save",
    "save_state",
    "shard_block",
    "tp_rule",
    "unmark",
]
assert set(__all__) == set(_EXPORTS), "keep __all__ and _EXPORTS in step"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # cache: later lookups skip this function
        return value
    raise AttributeError(f"module 'annot' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
