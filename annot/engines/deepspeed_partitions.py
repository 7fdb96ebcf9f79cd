"""Where DeepSpeed ZeRO-3 keeps a parameter on this rank, and keeping ZeRO++'s copies true.

Shared by the DeepSpeed engine (`annot.engines.deepspeed`) and its training state
(`annot.engines.deepspeed_state`), which both read ZeRO-3's partitions; kept apart from
the engine module so that the engine can hand out its training state without an import
cycle. DeepSpeed is imported inside the functions that need it.
"""

from __future__ import annotations

import torch
from torch import nn

from annot.meta.deferred import DeferredInitError
from annot.meta.layout import FlatPart, ShardLayout

__all__ = ["partition_range", "refresh_secondary_partitions", "shard_layout"]


def refresh_secondary_partitions(model: nn.Module) -> None:
    """Drop ZeRO++ hpZ's secondary partitions after annot wrote the primary ones
    (materialize, load, a training state): they were cut from the values before, and the
    next forward would gather them (wrong, silently; docs/design.md, pitfall 27).
    Without them the next forward gathers the primary partitions and DeepSpeed cuts new
    secondary ones when it releases the parameters, as it does after every step
    (``invalidate_secondary_tensor``)."""
    for param in model.parameters():
        if getattr(param, "ds_secondary_tensor", None) is not None:
            param.ds_secondary_tensor = None  # type: ignore[attr-defined]


def shard_layout(model: nn.Module) -> ShardLayout:
    """Where ZeRO-3 keeps ``model``'s parameters on this rank: partition ``r`` of each
    flattened, padded parameter in its ``ds_tensor`` on rank ``r`` of the parameter's
    group; a persisted (small) parameter also keeps its full value in ``.data``."""
    parts: dict[int, list[FlatPart]] = {}
    for param in model.parameters():
        partition = getattr(param, "ds_tensor", None)
        if partition is None:
            continue
        # OffloadDeviceEnum is a str enum. A partition swapped out to NVMe lives on disk,
        # and writing into its in-memory placeholder would be silently lost.
        if getattr(partition, "final_location", None) == "nvme":
            raise DeferredInitError(
                "a ZeRO-3 parameter partition is swapped out to NVMe (offload_param device "
                "'nvme'), so it cannot be filled in place: materialize or load the model "
                "before deepspeed.initialize (auto_wrap(..., load_from=...) does)")
        numel, shape = param.ds_numel, tuple(param.ds_shape)  # type: ignore[attr-defined]
        found = [FlatPart(partition, *partition_range(param), shape)]
        if param.data.numel() == numel:
            found.append(FlatPart(param.data.view(-1), 0, numel, shape))
        parts[id(param)] = found
    return ShardLayout(parts, engine="deepspeed", gather=_gather) if parts else ShardLayout()


def partition_range(param: torch.Tensor) -> tuple[int, int]:
    """The elements of ZeRO-3 ``param`` (flattened) that this rank's partition holds:
    partition ``r`` of the padded parameter on rank ``r`` of its group, cut at its end."""
    import deepspeed.comm

    size, numel = param.ds_tensor.ds_numel, param.ds_numel  # type: ignore[attr-defined]
    start = min(size * deepspeed.comm.get_rank(group=param.ds_process_group), numel)  # type: ignore[attr-defined]
    return start, min(start + size, numel)


def _gather(param: torch.Tensor) -> torch.Tensor:
    """The whole of a ZeRO-3 parameter. One parameter per gather: gathering a long list at
    once returned wrong halves on DeepSpeed 0.19 with gloo (measured)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()
