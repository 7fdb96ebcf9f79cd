"""ZeRO-3 with parameters offloaded to NVMe: partitions live on disk, so annot never fills
them in place. DeepSpeed's NVMe swapper needs libaio, absent on the CPU machines, so these
tests check the decision and the refusal rather than a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.engines.deepspeed import _params_swapped_to_nvme, shard_layout
from annot.meta.deferred import DeferredInitError
from examples.gpt.model import GPT


@pytest.mark.parametrize(("stage", "offload", "swapped"), [
    (3, "nvme", True),   # materialized whole, then partitioned by deepspeed.initialize
    (3, "cpu", False),   # partitioned unit by unit, partitions filled in CPU memory
    (3, None, False),
    (2, "nvme", False),  # stage 2 offloads the optimizer only: parameters stay in memory
])
def test_only_nvme_parameter_offload_skips_unit_by_unit_partitioning(tmp_path, stage, offload, swapped):
    model = GPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8)
    config = annot.deepspeed_config(model, stage=stage, offload=offload, nvme_path=str(tmp_path))
    assert _params_swapped_to_nvme(config) is swapped


def test_a_partition_swapped_to_nvme_is_never_filled_in_place():
    layer = nn.Linear(4, 4)
    for param in layer.parameters():
        # What ZeRO-3 leaves after swapping a partition out: an empty placeholder.
        param.ds_tensor = torch.empty(0)
        param.ds_tensor.final_location = "nvme"
    with pytest.raises(DeferredInitError, match="swapped out to NVMe.*before deepspeed.initialize"):
        shard_layout(layer)
