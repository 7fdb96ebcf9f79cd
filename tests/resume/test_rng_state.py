"""Each rank's RNG states through JSON on a CPU machine, with torch.cuda's functions and
DeepSpeed's model-parallel RNG tracker replaced by recording fakes: CUDA states are
saved before CUDA is initialised, restored onto the devices both runs see with the rest
named in the log, and the tracker's states come back."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from annot.engines import rng_state
from annot.engines.rng_state import rng_states, set_rng_states


def _state(value: int) -> torch.Tensor:
    """A stand-in for a device generator's state (a uint8 tensor, as torch's are)."""
    return torch.full((16,), value, dtype=torch.uint8)


class FakeCuda:
    """``devices`` visible CUDA devices, never initialised; records ``set_rng_state``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
        self.set: dict[int, torch.Tensor] = {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [_state(i + 1) for i in range(devices)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.refused)

    def set_rng_state(self, state: torch.Tensor, device: int = 0) -> None:
        assert 0 <= device < torch.cuda.device_count(), f"device {device} is not visible"
        self.set[device] = state.clone()

    def refused(self, states: list[torch.Tensor]) -> None:
        raise AssertionError("set_rng_state_all fails where fewer devices are visible than saved")


def _saved_on(monkeypatch: pytest.MonkeyPatch, devices: int) -> dict:
    with monkeypatch.context() as inner:
        FakeCuda(inner, devices)
        return rng_states()


def test_cuda_states_are_saved_before_cuda_is_initialised(monkeypatch):
    FakeCuda(monkeypatch, 2)
    states = rng_states()
    assert [rng_state._tensor(s)[0].item() for s in states["cuda"]] == [1, 2]


def test_cuda_states_restore_onto_fewer_devices_naming_the_dropped(monkeypatch, caplog):
    saved = _saved_on(monkeypatch, 3)
    cuda = FakeCuda(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger="annot"):
        set_rng_states(saved)
    assert {d: s[0].item() for d, s in cuda.set.items()} == {0: 1, 1: 2}
    assert "devices 2 dropped: saved on 3 devices, 2 visible" in caplog.text


def test_cuda_states_restore_onto_more_devices_naming_those_left_alone(monkeypatch, caplog):
    saved = _saved_on(monkeypatch, 1)
    cuda = FakeCuda(monkeypatch, 3)
    with caplog.at_level(logging.WARNING, logger="annot"):
        set_rng_states(saved)
    assert {d: s[0].item() for d, s in cuda.set.items()} == {0: 1}
    assert "CUDA devices 1, 2 keep their current RNG state" in caplog.text


def test_cuda_states_restore_silently_onto_the_same_devices(monkeypatch, caplog):
    saved = _saved_on(monkeypatch, 2)
    cuda = FakeCuda(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger="annot"):
        set_rng_states(saved)
    assert {d: s[0].item() for d, s in cuda.set.items()} == {0: 1, 1: 2}
    assert caplog.text == ""


def test_cuda_states_without_cuda_are_logged(monkeypatch, caplog):
    saved = _saved_on(monkeypatch, 2)
    FakeCuda(monkeypatch, 0)
    with caplog.at_level(logging.WARNING, logger="annot"):
        set_rng_states(saved)
    assert "CUDA RNG states of 2 device(s) were saved, but CUDA is not available" in caplog.text


class FakeTracker:
    """DeepSpeed's ``CudaRNGStatesTracker`` surface: a name -> state dictionary."""

    def __init__(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states


def _with_tracker(monkeypatch: pytest.MonkeyPatch, tracker: FakeTracker) -> None:
    module = types.ModuleType(rng_state._DEEPSPEED_CHECKPOINTING)
    module.get_cuda_rng_tracker = lambda: tracker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, rng_state._DEEPSPEED_CHECKPOINTING, module)


def test_deepspeed_tracker_states_round_trip(monkeypatch):
    FakeCuda(monkeypatch, 0)
    tracker = FakeTracker({"model-parallel-rng": _state(7)})
    _with_tracker(monkeypatch, tracker)
    saved = rng_states()
    tracker.set_states({"model-parallel-rng": _state(9)})  # the run draws on
    set_rng_states(saved)
    assert list(tracker.states_) == ["model-parallel-rng"]
    assert torch.equal(tracker.states_["model-parallel-rng"], _state(7))


def test_an_empty_deepspeed_tracker_adds_nothing(monkeypatch):
    FakeCuda(monkeypatch, 0)
    _with_tracker(monkeypatch, FakeTracker({}))
    assert "deepspeed_tracker" not in rng_states()


def test_cpu_python_and_numpy_states_round_trip():
    import random

    import numpy

    saved = rng_states()
    drawn = (torch.rand(3), random.random(), numpy.random.rand())
    set_rng_states(saved)
    again = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
