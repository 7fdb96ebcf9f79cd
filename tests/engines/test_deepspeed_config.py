"""`annot.deepspeed_config`: the dict says what it means (docs/design.md, pitfalls 9, 11, 12).
Training with it is checked against torch in test_parity.py (zero2/zero3 scenarios)."""

from __future__ import annotations

import pytest
import torch

import annot
from examples.gpt.model import GPT


@pytest.fixture
def model() -> GPT:
    return GPT(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def test_defaults_train_like_plain_pytorch(model):
    config = annot.deepspeed_config(model)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed 0.19 would clip at 1.0
    assert config["zero_allow_untested_optimizer"] is True
    zero = config["zero_optimization"]
    assert zero["stage"] == 2
    # Buffers sized from the Plan's largest unit, not DeepSpeed's fixed 5e8 elements.
    plan = annot.plan(model)
    unit = max(u.params for u in plan.units)
    assert unit > plan.root.params  # here a block is the largest unit
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == unit
    assert zero["contiguous_gradients"] is True and zero["overlap_comm"] is False
    assert "bf16" not in config and "fp16" not in config
    assert config["activation_checkpointing"]["number_checkpoints"] == 4  # the Plan's blocks


def test_a_plan_works_as_well_as_a_model(model):
    assert annot.deepspeed_config(annot.plan(model), stage=3) == annot.deepspeed_config(model, stage=3)


@pytest.mark.parametrize(("stage", "sections"), [(2, {"offload_optimizer"}),
                                                 (3, {"offload_optimizer", "offload_param"})])
def test_cpu_offload_by_stage(model, stage, sections):
    config = annot.deepspeed_config(model, stage=stage, offload="cpu")
    zero = config["zero_optimization"]
    assert {k for k in zero if k.startswith("offload")} == sections
    assert all(zero[s]["device"] == "cpu" for s in sections)
    assert config["zero_force_ds_cpu_optimizer"] is False  # a torch optimizer may be offloaded


def test_offload_follows_the_plan_marks(model):
    assert "offload_optimizer" not in annot.deepspeed_config(model)["zero_optimization"]
    annot.mark(model.transformer.h[0], offload="nvme")
    with pytest.raises(ValueError, match="nvme_path"):
        annot.deepspeed_config(model)
    zero = annot.deepspeed_config(model, stage=3, nvme_path="/nvme")["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": torch.cuda.is_available(),
                                     "nvme_path": "/nvme"}
    assert "offload_optimizer" not in annot.deepspeed_config(model, offload="none")["zero_optimization"]


def test_zero3_buffers_are_written_out_and_bounded(model):
    zero = annot.deepspeed_config(model, stage=3)["zero_optimization"]
    largest = max(u.params for u in annot.plan(model).units)
    assert zero["stage3_prefetch_bucket_size"] == largest
    assert zero["stage3_max_live_parameters"] == 2 * largest  # the running unit and the next
    assert zero["stage3_max_reuse_distance"] == largest
    assert zero["stage3_param_persistence_threshold"] == 100_000
    assert zero["overlap_comm"] is True


def test_zero3_can_offload_the_optimizer_alone(model):
    zero = annot.deepspeed_config(model, stage=3, offload="cpu", offload_params=False)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    with pytest.raises(ValueError, match="offload_params=True needs stage=3"):
        annot.deepspeed_config(model, stage=2, offload="cpu", offload_params=True)


@pytest.mark.parametrize(("precision", "section"), [("bf16", {"enabled": True}),
                                                    ("fp16", {"enabled": True, "loss_scale": 0})])
def test_precision(model, precision, section):
    assert annot.deepspeed_config(model, precision=precision)[precision] == section


@pytest.mark.parametrize(
    ("options", "match"),
    [(dict(stage=4), "stage"), (dict(precision="int8"), "precision"),
     (dict(offload="disk"), "offload"), (dict(stage=0, offload="cpu"), "stage 1")],
)
def test_bad_options_are_errors(model, options, match):
    with pytest.raises(ValueError, match=match):
        annot.deepspeed_config(model, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for DeepSpeed's CPU accelerator")
def test_zero3_cpu_checkpointing_is_refused_on_cpu(model):
    with pytest.raises(annot.EngineNotAvailableError, match="cpu_checkpointing"):
        annot.deepspeed_config(model, stage=3, cpu_checkpointing=True)
    assert annot.deepspeed_config(model, stage=2, cpu_checkpointing=True)["activation_checkpointing"][
        "cpu_checkpointing"
    ]


def test_deepspeed_checkpoint_keeps_a_one_tuple_and_the_gradient():
    pytest.importorskip("deepspeed")
    from annot.engines.deepspeed import deepspeed_checkpoint

    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = deepspeed_checkpoint(lambda t: (linear(t),), x)
    assert isinstance(out, tuple) and len(out) == 1  # DeepSpeed alone returns the bare tensor
    out[0].sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
    assert isinstance(deepspeed_checkpoint(linear, x), torch.Tensor)


def test_zero_plus_plus_keys_are_what_deepspeeds_parser_reads(model, monkeypatch):
    # hpZ runs on CPU (tests/engines/test_hsdp.py trains with it on 4 ranks); the
    # quantized collectives need DeepSpeed's CUDA kernels, so their keys are checked here.
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = annot.deepspeed_config(model, stage=3, hpz_partition_size=2)["zero_optimization"]
    assert DeepSpeedZeroConfig(**zero).zero_hpz_partition_size == 2
    assert "zero_hpz_partition_size" not in annot.deepspeed_config(model, stage=3)["zero_optimization"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    zero = annot.deepspeed_config(model, stage=3, quantized_weights=True,
                                  quantized_gradients=True)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    assert parsed.zero_quantized_weights and parsed.zero_quantized_gradients


@pytest.mark.parametrize(("options", "error", "match"), [
    (dict(stage=2, hpz_partition_size=2), ValueError, "hpz_partition_size.*ZeRO-3.*stage is 2"),
    (dict(stage=3, hpz_partition_size=0), ValueError, "positive int"),
    (dict(stage=3, quantized_weights=True), annot.EngineNotAvailableError, "CUDA quantizer"),
])
def test_zero_plus_plus_that_cannot_run_is_refused(model, options, error, match):
    if error is annot.EngineNotAvailableError and torch.cuda.is_available():
        pytest.skip("the quantized collectives run on GPUs")
    with pytest.raises(error, match=match):
        annot.deepspeed_config(model, **options)


def test_hpz_groups_must_divide_the_world(model):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="hpz_partition_size=3 does not divide the 4 ranks"):
            annot.deepspeed_config(model, stage=3, hpz_partition_size=3)
        assert annot.deepspeed_config(model, stage=3, hpz_partition_size=4)
    finally:
        dist.destroy_process_group()


def test_zero_plus_plus_goes_in_the_config_when_one_is_given():
    with pytest.raises(ValueError, match="ZeRO\\+\\+ in the config"):
        annot.DeepSpeedOptions(config={}, hpz_partition_size=2)
