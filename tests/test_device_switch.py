"""The suite's device switch (ANNOT_TEST_DEVICE, tests/distributed.py) and the ``gpu``
marker (tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.distributed import (
    ROOT,
    process_group_backend,
    rank_device,
    run_process,
    test_device,
    worker_env,
)


@pytest.mark.parametrize("nproc, gpus, backend", [(1, 1, "cpu:gloo,cuda:nccl"), (2, 8, "cpu:gloo,cuda:nccl"),
                                                  (2, 1, "gloo"), (8, 2, "gloo")])
def test_cuda_backend_is_nccl_with_a_gpu_per_rank_else_gloo(nproc, gpus, backend):
    assert process_group_backend("cuda", nproc, gpus) == backend


def test_cpu_backend_is_gloo_and_cuda_without_gpus_is_refused():
    assert process_group_backend("cpu", 2, 0) == "gloo"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        process_group_backend("cuda", 1, 0)


def test_ranks_get_their_own_gpu_or_all_share_cuda_0():
    assert [rank_device("cuda", r, 2, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [rank_device("cuda", r, 4, 2) for r in range(4)] == ["cuda:0"] * 4
    assert rank_device("cpu", 1, 2, 8) == "cpu"


def test_the_switch_reads_the_variable_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv("ANNOT_TEST_DEVICE", "CUDA")
    assert test_device() == "cuda"
    monkeypatch.delenv("ANNOT_TEST_DEVICE")
    assert test_device() == "cpu"
    monkeypatch.setenv("ANNOT_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ANNOT_TEST_DEVICE='tpu'"):
        test_device()


def test_workers_get_the_device_in_their_environment(monkeypatch):
    monkeypatch.setenv("ANNOT_TEST_DEVICE", "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = worker_env()
    assert env["ANNOT_TEST_DEVICE"] == "cuda" and "CUDA_VISIBLE_DEVICES" not in env


def test_cpu_workers_see_no_gpu(monkeypatch):
    monkeypatch.delenv("ANNOT_TEST_DEVICE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = worker_env()
    assert env["ANNOT_TEST_DEVICE"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.gpu
def test_a_test_marked_gpu_runs_only_where_cuda_is():
    assert torch.cuda.is_available()  # fails if the marker let it run without CUDA


@pytest.mark.slow
def test_cuda_asked_for_without_a_gpu_skips_with_the_reason():
    """A pytest run of one CPU test under ANNOT_TEST_DEVICE=cuda: skipped, reason given,
    where there is no CUDA device; run (and passed) where there is."""
    env = {**worker_env(), "ANNOT_TEST_DEVICE": "cuda"}
    target = f"{__file__}::test_ranks_get_their_own_gpu_or_all_share_cuda_0"
    proc = run_process([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", target],
                       env=env, cwd=ROOT, timeout=120)
    if torch.cuda.is_available():
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout
        assert "ANNOT_TEST_DEVICE=cuda: no CUDA device (found: torch" in proc.stdout
