"""Parameter and optimizer offload pin host memory only within the rank's budget
(docs/design.md, pitfall 44), the host's size mocked; no GPU is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot import host_memory
from annot.engines.fsdp2 import pin_offloaded_state
from annot.policies import by_class

GIB = 2**30
CUDA = torch.device("cuda", 0)


@pytest.fixture
def host_gib(tmp_path, monkeypatch):
    """Set the mocked host's memory in GiB (one rank, no cgroup limit)."""
    monkeypatch.setattr(host_memory, "_CGROUP_LIMIT", tmp_path / "absent")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_size(gib: float) -> None:
        meminfo = tmp_path / "meminfo"
        meminfo.write_text(f"MemTotal: {int(gib * GIB) // 1024} kB\n")
        monkeypatch.setattr(host_memory, "_MEMINFO", meminfo)

    return set_size


def mlp_plan() -> annot.Plan:
    """Four 1024x1024 fp32 blocks: 16 MiB of parameters."""
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4)))
    return annot.plan(model, by_class(nn.Linear))


def test_fsdp2_pins_offloaded_shards_that_fit(host_gib):
    host_gib(1)  # budget 512 MiB; parameters and gradients: 32 MiB
    assert pin_offloaded_state(mlp_plan(), True, CUDA, world=1)


def test_fsdp2_keeps_offloaded_shards_pageable_past_the_budget(host_gib):
    host_gib(1 / 32)  # budget 16 MiB; parameters and gradients: 32 MiB (the root holds none)
    assert pin_offloaded_state(mlp_plan(), True, CUDA, world=2)  # half each
    with pytest.warns(UserWarning, match="FSDP2's offloaded parameters and gradients"):
        assert not pin_offloaded_state(mlp_plan(), True, CUDA, world=1)


def test_fsdp2_pins_nothing_on_the_cpu_or_without_offload(host_gib):
    host_gib(1)
    assert not pin_offloaded_state(mlp_plan(), True, torch.device("cpu"), world=1)
    assert not pin_offloaded_state(mlp_plan(), False, CUDA, world=1)


def test_zero_offload_pins_its_host_state_only_within_the_budget(host_gib, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = mlp_plan()  # 4 Mi trained parameters: 64 MiB of ZeRO-Offload host state
    host_gib(1)
    zero = annot.deepspeed_config(plan, stage=2, offload="cpu")["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is True
    host_gib(1 / 16)
    with pytest.warns(UserWarning, match="ZeRO-Offload's host state"):
        zero = annot.deepspeed_config(plan, stage=2, offload="cpu")["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is False
