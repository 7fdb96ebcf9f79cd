"""How much host memory a rank may pin, with the host's size mocked: its share of half
the host (the smaller of MemTotal and the cgroup limit), pinned within it, pageable
with a warning past it (docs/design.md, pitfall 44)."""

from __future__ import annotations

import pytest
import torch

from annot import host_memory
from annot.runtime.host_buffers import HostBufferPool

GIB = 2**30


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host of 64 GiB (``/proc/meminfo``), no cgroup limit, one rank."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "memory.max"
    meminfo.write_text(f"MemTotal:       {64 * GIB // 1024} kB\nMemFree:  1 kB\n")
    cgroup.write_text("max\n")
    monkeypatch.setattr(host_memory, "_MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "_CGROUP_LIMIT", cgroup)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return cgroup


def test_the_budget_is_half_the_host_shared_by_the_nodes_ranks(host, monkeypatch):
    assert host_memory.host_memory_bytes() == 64 * GIB
    assert host_memory.pinned_budget() == 32 * GIB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_memory.pinned_budget() == 4 * GIB


def test_a_cgroup_limit_below_the_host_is_the_host(host):
    host.write_text(f"{16 * GIB}\n")
    assert host_memory.pinned_budget() == 8 * GIB


def test_state_within_the_budget_is_pinned(host):
    assert host_memory.pin_host_memory(32 * GIB, "the state", device="cuda")


def test_state_past_the_budget_is_pageable_with_a_warning_naming_it(host, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.warns(UserWarning, match=r"the state need 112.0 GiB .* budget of 4.0 GiB .* 8 rank"):
        assert not host_memory.pin_host_memory(112 * GIB, "the state", device="cuda")


def test_nothing_is_pinned_for_the_cpu(host):
    assert not host_memory.pin_host_memory(1, "the state", device="cpu")


def test_the_buffer_pool_goes_pageable_past_the_budget_and_warns_once(host, monkeypatch):
    monkeypatch.setattr(host_memory, "PINNED_FRACTION", 1e-12)  # a budget of a few bytes
    pool = HostBufferPool(pin=True)
    with pytest.warns(UserWarning, match="activation offload's host buffers") as warned:
        buffers = [pool.take(1024) for _ in range(3)]
    assert len(warned) == 1
    assert pool.pinned_bytes == 0 and not any(b.is_pinned() for b in buffers)
    assert all(b.dtype == torch.uint8 and b.numel() == 1024 for b in buffers)
