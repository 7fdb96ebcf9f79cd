"""The `Trainable`'s fp16 loss scaling in one process (no process group), and the
engines' choice of scaler and autocast from ``mixed_precision``: the scaled loss, the
skipped step, clipping in the loss's units, the scaler state's round trip, and a
training state saved with or without a scaler."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import annot
from annot.engines.base import INIT_SCALE
from annot.engines.ddp import DDP, DDPOptions
from annot.engines.fsdp1 import FSDP1, FSDP1Options
from annot.engines.fsdp2 import FSDP2, FSDP2Options

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CPU = torch.device("cpu")


def _trainable(scaled: bool) -> annot.Trainable:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if scaled else None
    return annot.Trainable(model, model, torch.optim.SGD(model.parameters(), lr=0.1), "local",
                           scaler=scaler)


def _gpt() -> nn.Module:
    from examples.gpt.model import GPT

    return GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def _backward(trainable: annot.Trainable, factor: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(1)
    trainable.backward(trainable(torch.randn(4, 6, generator=gen)).square().mean() * factor)


@pytest.mark.parametrize("options, scaler", [
    (FSDP2Options(mixed_precision="fp16"), "ShardedGradScaler"),
    (FSDP1Options(mixed_precision=torch.float16), "ShardedGradScaler"),
    (DDPOptions(mixed_precision="fp16"), "GradScaler"),
])
def test_fp16_compute_gets_a_scaler(options, scaler):
    engine = {FSDP2Options: FSDP2, FSDP1Options: FSDP1, DDPOptions: DDP}[type(options)]()
    got = engine.loss_scaler(options, CPU)
    assert type(got).__name__ == scaler and got.get_scale() == INIT_SCALE


@pytest.mark.parametrize("engine, options", [
    (FSDP2(), FSDP2Options(mixed_precision="bf16")), (FSDP2(), FSDP2Options()),
    (FSDP1(), FSDP1Options(mixed_precision="bf16")), (DDP(), DDPOptions(mixed_precision="bf16")),
    (DDP(), DDPOptions()),
])
def test_bf16_and_fp32_get_no_scaler(engine, options):
    assert engine.loss_scaler(options, CPU) is None


def test_the_first_scale_fits_fp16():
    # An fp16 loss's gradient is the scale itself: 2^16 overflows fp16 (max 65504).
    assert torch.tensor(INIT_SCALE, dtype=torch.float16).isfinite()


def test_ddp_refuses_a_mixed_precision_it_cannot_autocast_to():
    with pytest.raises(ValueError, match="engine 'ddp' takes mixed_precision"):
        DDPOptions(mixed_precision=torch.float64)


def test_ddp_mixed_precision_is_an_option_no_longer_a_hint():
    assert "mixed_precision" not in DDP.hints
    assert DDP().options(None, mixed_precision="fp16").mixed_precision is torch.float16


@pytest.mark.parametrize("engine, scaler", [
    ("fsdp2", "ShardedGradScaler"), ("fsdp1", "ShardedGradScaler"), ("ddp", "GradScaler")])
def test_auto_wrap_gives_an_fp16_trainable_its_engines_scaler(one_rank, engine, scaler):
    trainable = annot.auto_wrap(_gpt(), engine, mixed_precision="fp16",
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert type(trainable.scaler).__name__ == scaler


def test_fp16_without_optimizer_logs_that_the_module_does_not_scale(one_rank, caplog):
    with caplog.at_level(logging.WARNING, logger="annot"):
        annot.auto_wrap(_gpt(), "ddp", mixed_precision="fp16")
    assert "does not scale the loss: pass optimizer=" in caplog.text


def test_ddp_mixed_precision_runs_the_forward_under_autocast(one_rank):
    wrapped = annot.auto_wrap(_gpt(), "ddp", mixed_precision="bf16")
    logits, _ = wrapped(torch.zeros(1, 4, dtype=torch.long))
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())


def test_scaled_gradients_are_the_unscaled_ones_times_the_scale():
    plain, scaled = _trainable(False), _trainable(True)
    _backward(plain)
    _backward(scaled)
    for p, s in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s.grad, p.grad * INIT_SCALE, rtol=1e-6, atol=0)


def test_step_applies_the_unscaled_update():
    plain, scaled = _trainable(False), _trainable(True)
    for t in (plain, scaled):
        _backward(t)
        t.step()
    for p, s in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s, p, rtol=1e-6, atol=1e-7)
    assert scaled.skipped_steps == 0


def test_an_inf_skips_the_step_counts_and_logs_it(caplog):
    trainable = _trainable(True)
    before = [p.detach().clone() for p in trainable.parameters()]
    _backward(trainable, float("inf"))
    with caplog.at_level(logging.WARNING, logger="annot"):
        trainable.step()
    assert all(torch.equal(a, b) for a, b in zip(before, trainable.parameters(), strict=True))
    assert trainable.skipped_steps == 1
    assert trainable.scaler.get_scale() == INIT_SCALE / 2
    assert "optimizer step skipped" in caplog.text


def test_clip_grad_norm_unscales_first():
    plain, scaled = _trainable(False), _trainable(True)
    _backward(plain)
    _backward(scaled)
    expected = plain.clip_grad_norm_(0.01)
    got = scaled.clip_grad_norm_(0.01)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for p, s in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s.grad, p.grad, rtol=1e-5, atol=1e-9)
    scaled.step()  # the scaler does not unscale twice
    plain.step()
    for p, s in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(s, p, rtol=1e-5, atol=1e-8)


def test_the_scaler_state_round_trips_through_save_and_load_state(tmp_path):
    trainable = _trainable(True)
    _backward(trainable, float("inf"))
    trainable.step()   # backed off, one skipped
    trainable.zero_grad()
    _backward(trainable)
    trainable.step()   # growth tracker 1
    annot.save_state(tmp_path, trainable, step=2)
    fresh = _trainable(True)
    annot.load_state(tmp_path, fresh)
    assert fresh.scaler.state_dict() == trainable.scaler.state_dict() != _trainable(True).scaler.state_dict()
    assert fresh.skipped_steps == 1


def test_a_state_saved_without_a_scaler_loads_into_fp16_at_the_first_scale(tmp_path, caplog):
    annot.save_state(tmp_path, _trainable(False), step=1)
    fresh = _trainable(True)
    with caplog.at_level(logging.WARNING, logger="annot"):
        annot.load_state(tmp_path, fresh)
    assert fresh.scaler.get_scale() == INIT_SCALE
    assert "holds no loss scaler state" in caplog.text


def test_a_scaler_state_into_a_run_without_one_is_logged(tmp_path, caplog):
    annot.save_state(tmp_path, _trainable(True), step=1)
    with caplog.at_level(logging.WARNING, logger="annot"):
        annot.load_state(tmp_path, _trainable(False))
    assert "does not scale its loss" in caplog.text
