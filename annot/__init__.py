"""annot: shard, checkpoint and offload PyTorch models too large for one GPU.

Mark blocks (or pass a policy), look at the Plan, then apply it to an engine.
Names are loaded on first use (PEP 562), so ``import annot`` and the ``annot rewrite``
command start without importing torch; deepspeed, transformers and safetensors are
imported only inside the functions that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from annot.markers import checkpoint_block, get_mark, mark, offload_block, shard_block, unmark
    from annot.planning import plan
    from policies import (
        Plan,
        Policy,
        by_class,
        by_name,
        by_size,
        every_nth,
        marked,
        no_split_modules,
        repeated_blocks,
    )
    from policies.errors import AnnotError, PlanError

_EXPORTS = {
    "AnnotError": "policies.errors",
    "PlanError": "policies.errors",
    "Plan": "policies",
    "Policy": "policies",
    "by_class": "policies",
    "by_name": "policies",
    "by_size": "policies",
    "every_nth": "policies",
    "marked": "policies",
    "no_split_modules": "policies",
    "repeated_blocks": "policies",
    "checkpoint_block": "annot.markers",
    "get_mark": "annot.markers",
    "mark": "annot.markers",
    "offload_block": "annot.markers",
    "shard_block": "annot.markers",
    "unmark": "annot.markers",
    "plan": "annot.planning",
}

__all__ = [
    "AnnotError",
    "Plan",
    "PlanError",
    "Policy",
    "by_class",
    "by_name",
    "by_size",
    "checkpoint_block",
    "every_nth",
    "get_mark",
    "mark",
    "marked",
    "no_split_modules",
    "offload_block",
    "plan",
    "repeated_blocks",
    "shard_block",
    "unmark",
]
assert set(__all__) == set(_EXPORTS), "keep __all__ and _EXPORTS in step"
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # cache: later lookups skip this function
        return value
    raise AttributeError(f"module 'annot' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
