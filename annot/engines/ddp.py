"""DDP (``DistributedDataParallel``) driven by a Plan.

DDP replicates the whole model, so the Plan's shard units play no part; its
checkpointing and activation offload do (DDP cannot offload parameters, so a Plan's
offload mark means activation offload here: `annot.runtime.activation_offload`). The order of
steps: move the model to this rank's device, checkpoint the Plan's modules, hook
activation offload around the offloaded ones, then wrap (DDP registers its gradient
hooks on the parameters as they are at wrap time, and broadcasts rank 0's parameters
and buffers to the others).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.runtime.activation_offload import apply_activation_offload

__all__ = ["apply_ddp"]


def apply_ddp(
    model: nn.Module,
    *,
    checkpoint_paths: Sequence[str],
    device: torch.device,
    offload_activation_paths: Sequence[str] = (),
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP on ``device``; its ``.module`` is ``model`` with unchanged names.

    ``offload_activation_paths``: modules whose saved activations wait on the host."""
    model.to(device)
    apply_checkpointing(model, checkpoint_paths)
    apply_activation_offload(model, offload_activation_paths)
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
