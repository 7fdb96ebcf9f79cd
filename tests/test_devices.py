"""The device and backend annot picks (`annot.devices`, `annot.init_distributed`), as
torchrun, srun and Slurm users expect them (issue #30). The machine has no GPU: the CUDA
side is mocked (device count, ``set_device``), and what annot asks of torch is recorded."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import annot
from annot import devices, process_group

LAUNCH_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees ``n`` GPUs (``gpus(n)``); returns the list of indices
    ``torch.cuda.set_device`` was called with. No launcher variables unless a test sets them."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    current: list[int] = []

    def see(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", current.append)  # annot passes an index
        return current
    return see


def test_local_rank_3_on_a_one_gpu_task_gets_cuda_0(gpus, monkeypatch):
    set_to = gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "3")  # srun, one GPU per task: each task sees cuda:0 only
    assert devices.choose_device("cuda") == torch.device("cuda", 0)
    assert set_to == [0]


def test_an_nccl_backend_without_device_takes_local_rank_modulo_the_gpus(gpus, monkeypatch):
    set_to = gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.choose_device(backend="nccl") == torch.device("cuda", 1)
    assert set_to == [1]


def test_slurm_localid_stands_in_for_local_rank(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert devices.choose_device("cuda") == torch.device("cuda", 2)


def test_a_gloo_group_without_device_stays_on_the_cpu(gpus, monkeypatch):
    set_to = gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 1 of a 2-rank gloo test on a one-GPU box
    assert devices.choose_device(backend="gloo") == torch.device("cpu")
    assert set_to == []


def test_the_default_group_s_backend_decides_without_device(gpus, one_rank):
    set_to = gpus(1)
    assert devices.choose_device() == torch.device("cpu")  # one_rank is gloo
    assert set_to == []


def test_ranks_outnumbering_gpus_on_gloo_share_cuda_0_when_cuda_is_asked_for(gpus, monkeypatch):
    set_to = gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    chosen = []
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.warns(UserWarning, match="2 ranks on this node share 1 GPU"):
            chosen.append(devices.choose_device("cuda", backend="gloo"))
    assert chosen == [torch.device("cuda", 0)] * 2
    assert set_to == [0, 0]


def test_ranks_outnumbering_gpus_without_a_group_or_device_stay_on_the_cpu(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.choose_device() == torch.device("cpu")


def test_an_explicit_device_becomes_the_current_device(gpus):
    set_to = gpus(2)
    assert devices.choose_device("cuda:1") == torch.device("cuda", 1)
    assert set_to == [1]


def test_an_explicit_cpu_device_is_kept_and_sets_nothing(gpus):
    set_to = gpus(2)
    assert devices.choose_device(torch.device("cpu"), backend="nccl") == torch.device("cpu")
    assert set_to == []


def test_cuda_asked_for_without_a_gpu_says_what_was_found(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(annot.DeviceNotAvailableError) as error:
        devices.choose_device("cuda")
    message = str(error.value)
    assert "device='cuda' needs a CUDA GPU" in message
    assert "torch.cuda.device_count() is 0" in message
    assert f"torch {torch.__version__} is" in message
    assert "CUDA_VISIBLE_DEVICES is ''" in message


def test_an_nccl_backend_without_a_gpu_is_the_same_error(gpus):
    gpus(0)
    with pytest.raises(annot.DeviceNotAvailableError, match="backend 'nccl' needs a CUDA GPU"):
        devices.choose_device(backend="nccl")


def test_a_gpu_index_this_process_does_not_see_is_refused(gpus):
    gpus(1)
    with pytest.raises(annot.DeviceNotAvailableError, match=r"sees 1 CUDA device\(s\) \(cuda:0..cuda:0\)"):
        devices.choose_device("cuda:1")


@pytest.mark.parametrize(("backend", "on_cuda"), [
    ("gloo", False), ("nccl", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", True),
    ("mpi", False),
])
def test_which_backends_put_collectives_on_cuda(backend, on_cuda):
    assert devices.uses_cuda(backend) is on_cuda


def test_cuda_ranks_get_nccl_for_cuda_and_gloo_for_cpu_tensors(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert devices.distributed_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert devices.distributed_backend(torch.device("cpu")) == "gloo"


def test_more_ranks_than_gpus_get_gloo_which_lets_them_share_one(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # NCCL would refuse two ranks on cuda:0
    assert devices.distributed_backend(torch.device("cuda", 0)) == "gloo"


@pytest.fixture
def recorded_init(monkeypatch):
    """``dist.init_process_group`` replaced by a recorder (no group is made)."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    return calls


def test_init_distributed_on_a_gpu_joins_nccl_and_gloo_bound_to_the_rank_s_gpu(gpus, monkeypatch,
                                                                               recorded_init):
    set_to = gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert process_group.init_distributed(timeout=30) == torch.device("cuda", 1)
    [(args, kwargs)] = recorded_init
    assert args == ("cpu:gloo,cuda:nccl",)
    assert kwargs == {"timeout": datetime.timedelta(seconds=30), "device_id": torch.device("cuda", 1)}
    assert set_to == [1]


def test_init_distributed_without_a_gpu_joins_gloo_with_no_device_id(gpus, recorded_init):
    gpus(0)
    assert process_group.init_distributed() == torch.device("cpu")
    [(args, kwargs)] = recorded_init
    assert args == ("gloo",) and kwargs["device_id"] is None


def test_init_distributed_with_gloo_asked_for_stays_on_the_cpu_on_a_gpu_box(gpus, recorded_init):
    set_to = gpus(1)
    assert process_group.init_distributed("gloo") == torch.device("cpu")
    [(args, kwargs)] = recorded_init
    assert args == ("gloo",) and kwargs["device_id"] is None
    assert set_to == []


class _Recorder(torch.nn.Module):
    """Records the device of every tensor its forward receives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor, *, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen += [x.device, extra["mask"].device]
        return x


def test_a_trainable_moves_cpu_inputs_to_its_device():
    recorder = _Recorder()
    trainable = annot.Trainable(recorder, recorder, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]),
                                "any", torch.device("meta"))  # a device other than the batch's
    trainable(torch.ones(2), extra={"mask": torch.ones(2)})
    assert recorder.seen == [torch.device("meta")] * 2


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2"])
def test_torch_engines_give_the_trainable_the_request_s_device(engine):
    from annot.engines.registry import get_engine

    model = torch.nn.Linear(2, 2)
    steps = get_engine(engine)
    trainable = steps.trainable(model, model, lambda p: torch.optim.SGD(p, lr=0.1),
                                steps.options(None), device=torch.device("meta"))
    assert trainable.device == torch.device("meta")


def test_deepspeed_s_trainable_moves_inputs_and_names_the_gpu(monkeypatch):
    """DeepSpeed's engine moves no input and takes its GPU from LOCAL_RANK unless given
    ``device_rank``: both come from annot's device."""
    deepspeed = pytest.importorskip("deepspeed")
    from annot.engines.deepspeed import DeepSpeed

    recorder = _Recorder()
    given = {}

    def initialize(**kwargs):
        given.update(kwargs)
        return recorder, kwargs["optimizer"](kwargs["model_parameters"]), None, None
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    model = torch.nn.Linear(2, 2)
    trainable = DeepSpeed().trainable(model, model, lambda p: torch.optim.SGD(p, lr=0.1), None,
                                      device=torch.device("cuda", 3))
    assert given["args"].device_rank == 3
    trainable.device = torch.device("meta")  # no GPU here: watch the move to another device
    trainable(torch.ones(2), extra={"mask": torch.ones(2)})
    assert recorder.seen == [torch.device("meta")] * 2


def test_deepspeed_on_a_gpu_accelerator_refuses_the_cpu(monkeypatch):
    """A gloo group on a GPU machine keeps annot on the CPU; DeepSpeed would still put the
    model on its GPU and get CPU batches."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from annot.engines.deepspeed import refuse_other_accelerator

    monkeypatch.setattr(type(get_accelerator()), "device_name", lambda self, index=None: "cuda")
    with pytest.raises(ValueError, match="computes on its 'cuda' accelerator, but the device is cpu"):
        refuse_other_accelerator(torch.device("cpu"))
    refuse_other_accelerator(torch.device("cuda", 0))  # its own type passes


def test_deepspeed_on_the_cpu_accelerator_takes_the_cpu_and_gpu_plans():
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from annot.engines.deepspeed import refuse_other_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's accelerator here is a GPU")
    refuse_other_accelerator(torch.device("cpu"))
    refuse_other_accelerator(torch.device("cuda", 0))  # a GPU plan checked without a GPU


def test_auto_wrap_on_a_gloo_group_with_a_gpu_present_trains_on_the_cpu(gpus, monkeypatch, one_rank):
    """The issue's case: a gloo test on a GPU box asked for cuda:LOCAL_RANK (rank 1 of 2 on
    one GPU: "invalid device ordinal")."""
    set_to = gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    trainable = annot.auto_wrap(model, "ddp", annot.by_class(torch.nn.Linear),
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert trainable.device == torch.device("cpu")
    assert set_to == []


def test_init_distributed_joins_a_real_gloo_group_on_a_cpu_machine(gpus, monkeypatch):
    from tests.distributed import free_port

    gpus(0)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(key, value)
    try:
        assert process_group.init_distributed(timeout=30) == torch.device("cpu")
        assert dist.get_backend() == "gloo"
        assert process_group.init_distributed() == torch.device("cpu")  # joined: the device only
    finally:
        dist.destroy_process_group()
