"""The GPU-kind table: memory as the driver reports it, and a reserve per process that
grows with its NCCL communicators."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.memory import MemoryInputError
from annot.memory.gpu_kinds import GPU_KINDS, gpu_kind
from examples.gpt.model import GPT

GiB = 2**30


def test_an_h100_has_less_than_80_gib():
    assert 79 * GiB < GPU_KINDS["H100"].memory < 80 * GiB


def test_the_kind_is_found_in_the_device_name():
    assert gpu_kind(None, "NVIDIA H100 80GB HBM3").name == "H100"
    assert gpu_kind(None, "NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    with pytest.raises(MemoryInputError, match="unknown GPU kind"):
        gpu_kind("V100")


def test_the_reserve_counts_communicators():
    h100 = GPU_KINDS["H100"]
    assert h100.reserve(2) - h100.reserve(1) == h100.nccl
    assert h100.reserve(0) == h100.context + h100.cublas


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is the visible GPU's memory")
def test_the_report_defaults_to_the_kind():
    with torch.device("meta"):
        model = GPT(n_layer=1, vocab_size=64, block_size=8, n_head=2, n_embd=16)
    one = annot.estimate_memory(model, gpus=1, batch=1, seq=8, host_mem=GiB)
    many = annot.estimate_memory(model, gpus=8, batch=1, seq=8, host_mem=GiB, gpu="A100")
    assert one.gpu_mem == GPU_KINDS["H100"].memory and one.reserve == GPU_KINDS["H100"].reserve(0)
    assert many.gpu_mem == GPU_KINDS["A100"].memory and many.reserve == GPU_KINDS["A100"].reserve(1)
