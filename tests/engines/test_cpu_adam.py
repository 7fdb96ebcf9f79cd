"""ZeRO-Offload's optimizer: which path is taken (DeepSpeed's CPU Adam, or torch's with a
warning naming the cost), with the CPU Adam class given by the test. One test of the
sweep lane builds the real kernel and trains with it against torch's AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from annot.engines.deepspeed_cpu_adam import host_optimizer_factory, offloads_optimizer
from annot.errors import EngineNotAvailableError

OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


class FakeCPUAdam(torch.optim.Optimizer):
    """Stands for DeepSpeedCPUAdam: records how it was built."""

    def __init__(self, params, adamw_mode=True):
        super().__init__(params, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                      bias_correction=True))
        self.adamw_mode = adamw_mode


def fake_load():
    return FakeCPUAdam


def failed_load():
    raise RuntimeError("g++ not found")


def params():
    return [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]


def adamw(p):
    return torch.optim.AdamW(p, lr=0.25, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5)


def test_offload_in_the_config_is_what_swaps():
    assert offloads_optimizer(OFFLOAD)
    assert not offloads_optimizer({"zero_optimization": {"stage": 2}})
    factory = host_optimizer_factory(adamw, {"zero_optimization": {"stage": 2}}, choice=None,
                                     on_gpu=True, load=fake_load)
    assert factory is adamw


@pytest.mark.parametrize(("torch_optimizer", "adamw_mode"), [(adamw, True), (torch.optim.Adam, False)])
def test_on_a_gpu_adam_and_adamw_become_cpu_adam_with_their_settings(torch_optimizer, adamw_mode):
    built = host_optimizer_factory(torch_optimizer, OFFLOAD, choice=None, on_gpu=True, load=fake_load)(params())
    assert type(built) is FakeCPUAdam and built.adamw_mode is adamw_mode
    reference = torch_optimizer(params())
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert built.param_groups[0][key] == reference.param_groups[0][key]


def test_a_failed_build_keeps_torchs_optimizer_and_warns_the_cost():
    factory = host_optimizer_factory(adamw, OFFLOAD, choice=None, on_gpu=True, load=failed_load)
    with pytest.warns(UserWarning, match=r"steps torch's AdamW on the host.*g\+\+ not found.*slower"):
        built = factory(params())
    assert type(built) is torch.optim.AdamW


def test_cpu_adam_asked_for_and_not_built_is_an_error():
    factory = host_optimizer_factory(adamw, OFFLOAD, choice=True, on_gpu=False, load=failed_load)
    with pytest.raises(EngineNotAvailableError, match="cpu_adam=True.*g\\+\\+ not found"):
        factory(params())


def test_on_deepspeeds_cpu_accelerator_torchs_optimizer_stays_unless_asked():
    def never():
        raise AssertionError("built without being asked")

    assert type(host_optimizer_factory(adamw, OFFLOAD, choice=None, on_gpu=False, load=never)(params())) \
        is torch.optim.AdamW
    assert type(host_optimizer_factory(adamw, OFFLOAD, choice=True, on_gpu=False, load=fake_load)(params())) \
        is FakeCPUAdam


def test_settings_cpu_adam_lacks_keep_torchs_optimizer_with_the_reason():
    def amsgrad(p):
        return torch.optim.AdamW(p, amsgrad=True)

    with pytest.warns(UserWarning, match="amsgrad=True"):
        built = host_optimizer_factory(amsgrad, OFFLOAD, choice=None, on_gpu=True, load=fake_load)(params())
    assert type(built) is torch.optim.AdamW


def test_other_optimizers_and_cpu_adam_false_are_left_alone():
    sgd = host_optimizer_factory(lambda p: torch.optim.SGD(p, lr=0.1), OFFLOAD, choice=None,
                                 on_gpu=True, load=failed_load)(params())
    kept = host_optimizer_factory(adamw, OFFLOAD, choice=False, on_gpu=True, load=failed_load)(params())
    assert type(sgd) is torch.optim.SGD and type(kept) is torch.optim.AdamW


# The sweep lane: the first run JIT-builds the kernel (measured 8 min on the loaded
# 2-core machine), beyond the default lane's time budget.
@pytest.mark.sweep
@pytest.mark.distributed
def test_zero_offload_trains_and_resumes_on_the_built_cpu_adam(one_rank, tmp_path, monkeypatch):
    """The real kernel (JIT-built on first use: minutes once per machine) on DeepSpeed's
    CPU accelerator with cpu_adam=True: 3 steps within 1e-5 of torch's AdamW on the same
    batches, and a save/resume bitwise (CPU Adam's int step through the state)."""
    import annot

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed reads it itself (torchrun sets it)
    from tests.engines.small_gpt import gpt, tokens

    def train(trainable, model, steps):
        idx = tokens(model, batch=2)
        losses = []
        for _ in range(steps):
            _, loss = trainable(idx, idx)
            trainable.backward(loss)
            trainable.step()
            trainable.zero_grad()
            losses.append(loss.item())
        return losses

    def adamw_of(p):
        return torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1)

    reference = gpt()
    optimizer = adamw_of(reference.parameters())
    expected = []
    for _ in range(3):
        idx = tokens(reference, batch=2)
        _, loss = reference(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())

    model = gpt()
    trainable = annot.auto_wrap(model, "deepspeed", stage=2, offload="cpu", cpu_adam=True,
                                checkpoint=False, optimizer=adamw_of, device="cpu")
    assert type(trainable.module.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    losses = train(trainable, model, 3)
    assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) <= 1e-5
    annot.save_state(tmp_path, trainable, step=3)
    continued = train(trainable, model, 2)

    again = gpt()
    resumed = annot.auto_wrap(again, "deepspeed", stage=2, offload="cpu", cpu_adam=True,
                              checkpoint=False, optimizer=adamw_of, device="cpu")
    annot.load_state(tmp_path, resumed)
    assert train(resumed, again, 2) == continued
