"""DDP (``DistributedDataParallel``) driven by a Plan.

DDP replicates the whole model, so the Plan's shard units play no part; its
checkpointing does. The order of steps: move the model to this rank's device, checkpoint
the Plan's modules, then wrap (DDP registers its gradient hooks on the parameters as
they are at wrap time, and broadcasts rank 0's parameters and buffers to the others).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from annot.activation_checkpoint import apply_checkpointing

__all__ = ["apply_ddp"]


def apply_ddp(
    model: nn.Module, *, checkpoint_paths: Sequence[str], device: torch.device
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP on ``device``; its ``.module`` is ``model`` with unchanged names."""
    model.to(device)
    apply_checkpointing(model, checkpoint_paths)
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
