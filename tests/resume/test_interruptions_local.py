"""One process, no process group: `annot.resume_state` past damaged saves,
`annot.Interruptions` (a signal saves at the step boundary and exits 0, the handlers
come back, refusals), what counts as a collective failure, and the restart attempt's
store. The 2-rank launches with torchrun's restarts are tests/resume/test_interruptions.py."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch
from torch import nn

import annot
from annot.collective_hangs import is_collective_failure
from annot.process_group import attempt_store
from annot.resume import PROGRESS_FILE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trainable(seed: int = 0) -> annot.Trainable:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return annot.Trainable(model, model, torch.optim.AdamW(model.parameters(), lr=1e-2), "local")


def _step(trainable: annot.Trainable, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    trainable.backward(trainable(torch.randn(4, 6, generator=gen)).square().mean())
    trainable.step()
    trainable.zero_grad()


def _weights(trainable: annot.Trainable) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainable.model.parameters()]


def test_a_damaged_newest_save_is_named_and_the_one_before_it_loads(tmp_path, caplog):
    trainable = _trainable()
    for step in range(4):
        _step(trainable, step)
        if step + 1 in (2, 4):
            annot.save_state(tmp_path, trainable, step=step + 1)
            if step + 1 == 2:
                at_two = _weights(trainable)
    shard = next((tmp_path / "step-00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    fresh = _trainable(seed=1)
    with caplog.at_level(logging.WARNING, logger="annot"):
        resumed = annot.resume_state(tmp_path, fresh)
    assert resumed is not None and resumed.step == 2
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), at_two, strict=True))
    assert "step-00000004: not loadable (CheckpointError" in caplog.text and "wrong size" in caplog.text
    # load_state itself still takes the newest, and says why it cannot.
    with pytest.raises(annot.CheckpointError, match="wrong size"):
        annot.load_state(tmp_path, _trainable())


def test_a_save_whose_bytes_do_not_read_is_passed_over_too(tmp_path, caplog):
    # The sizes match the commit record, the contents do not read: the load itself fails
    # (DCP raises a BaseException, CheckpointException), and the save before it is taken.
    trainable = _trainable()
    for step in (1, 2):
        _step(trainable, step)
        annot.save_state(tmp_path, trainable, step=step)
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))
    with caplog.at_level(logging.WARNING, logger="annot"):
        resumed = annot.resume_state(tmp_path, _trainable(seed=3))
    assert resumed is not None and resumed.step == 1
    assert "step-00000002: not loadable" in caplog.text


def test_no_save_at_all_starts_fresh(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="annot"):
        assert annot.resume_state(tmp_path / "none", _trainable()) is None
    assert "no loadable training state; starting from step 0" in caplog.text


def test_a_signal_is_only_recorded_then_the_step_boundary_saves_and_exits_0(tmp_path, caplog):
    trainable = _trainable()
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as exited, caplog.at_level(logging.WARNING, logger="annot"):
        with annot.Interruptions(tmp_path, trainable) as run:
            assert run.resume() == 0
            for step in range(10):
                _step(trainable, step)
                if step == 2:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    assert run.received == signal.SIGUSR1
                    assert annot.latest_state(tmp_path) is None  # nothing saved in the handler
                run.step_done(step + 1)
    assert exited.value.code == 0
    assert signal.getsignal(signal.SIGUSR1) is before  # the handlers come back
    assert annot.latest_state(tmp_path).name == "step-00000003"
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["step"] == 3
    assert "SIGUSR1: saved step 3" in caplog.text
    # The saved state resumes where the run stopped.
    again = _trainable(seed=5)
    with annot.Interruptions(tmp_path, again) as run:
        assert run.resume() == 3
    assert all(torch.equal(a, b) for a, b in zip(_weights(again), _weights(trainable), strict=True))


def test_without_exit_the_step_boundary_says_so(tmp_path):
    trainable = _trainable()
    with annot.Interruptions(tmp_path, trainable, signals=[signal.SIGUSR2], exit=False) as run:
        assert run.step_done(1) is False
        os.kill(os.getpid(), signal.SIGUSR2)
        assert run.step_done(2) is True
    assert annot.latest_state(tmp_path).name == "step-00000002"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(TypeError, match="Trainable"):
        annot.Interruptions(tmp_path, nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collective_timeout"):
        annot.Interruptions(tmp_path, _trainable(), collective_timeout=0)
    with pytest.raises(ValueError, match="positive"):
        annot.set_collective_timeout(-1)
    with pytest.raises(ValueError, match="'thread' or 'process'"):
        annot.save_state(tmp_path, _trainable(), step=1, async_save="fork")


def test_collective_failures_are_told_from_other_errors():
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                              "5000ms for recv operation to complete"))
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("timed out"))  # not a backend's error


def test_outside_torchruns_agent_store_the_process_group_starts_as_torch_does(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    import datetime

    assert attempt_store(datetime.timedelta(seconds=1)) is None
