"""annot: shard, checkpoint and offload PyTorch models too large for one GPU.

Mark blocks (or pass a policy), look at the Plan, then apply it to an engine.
Heavy dependencies (deepspeed, transformers, safetensors) are imported only inside
the functions that need them, so ``import annot`` stays light.
"""

from __future__ import annotations

from annot.markers import checkpoint_block, get_mark, mark, offload_block, shard_block, unmark
from policies.errors import AnnotError, PlanError

__all__ = [
    "AnnotError",
    "PlanError",
    "checkpoint_block",
    "get_mark",
    "mark",
    "offload_block",
    "shard_block",
    "unmark",
]

__version__ = "0.1.0"
