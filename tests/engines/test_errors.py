"""Misuse that the engines punish late is refused up front, with the fix in the message.

Checks that need a process group use a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import annot
from examples.gpt.model import GPT

pytestmark = pytest.mark.distributed


def small_gpt() -> GPT:
    return GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def test_unknown_engine_names_the_choices():
    with pytest.raises(ValueError, match="unknown engine 'zero9'.*ddp.*fsdp2"):
        annot.auto_wrap(small_gpt(), "zero9")


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "ddp", "deepspeed"])
def test_without_a_process_group_the_error_says_torchrun_and_init_process_group(engine):
    assert not dist.is_initialized()
    with pytest.raises(annot.ProcessGroupNotInitializedError) as info:
        annot.auto_wrap(small_gpt(), engine)
    assert "torchrun" in str(info.value) and "init_process_group" in str(info.value)
    assert isinstance(info.value, annot.AnnotError)


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "ddp", "deepspeed"])
def test_a_meta_model_without_a_meta_init_record_is_refused(one_rank, engine):
    with torch.device("meta"):
        model = small_gpt()
    with pytest.raises(annot.MetaDeviceError, match="meta device.*annot.meta_init"):
        annot.auto_wrap(model, engine)


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_a_meta_init_model_is_materialized_with_eager_values(one_rank, engine):
    torch.manual_seed(5)
    with annot.meta_init():
        model = small_gpt()
    wrapped = annot.auto_wrap(model, engine)
    torch.manual_seed(5)
    eager = small_gpt()
    for (name, got), (_, want) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(full, want), name
    x = torch.randint(0, 64, (2, 8))
    assert torch.equal(wrapped(x, x)[1], eager(x, x)[1])


def test_an_optimizer_built_before_fsdp2_fails_at_its_first_step(one_rank):
    model = small_gpt()
    stale = torch.optim.AdamW(model.parameters())
    wrapped = annot.auto_wrap(model, "fsdp2")
    x = torch.randint(0, 64, (2, 8))
    wrapped(x, x)[1].backward()
    with pytest.raises(annot.OptimizerOrderError, match="Build the optimizer after wrapping"):
        stale.step()
    torch.optim.AdamW(wrapped.parameters()).step()  # one built after wrapping steps


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "ddp"])
def test_parameters_added_after_wrapping_are_refused_at_the_first_step(one_rank, engine):
    # No engine synchronises a parameter it never saw: ranks would train different values.
    model = small_gpt()
    wrapped = annot.auto_wrap(model, engine)
    model.transformer.h[0].adapter = torch.nn.Linear(32, 32)  # what get_peft_model adds
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with pytest.raises(annot.OptimizerOrderError,
                       match=r"^transformer.h.0.adapter.weight, transformer.h.0.adapter.bias "
                             r"joined \w*GPT after annot.auto_wrap"):
        optimizer.step()


def test_an_optimizer_built_before_fsdp1_holds_the_parameters_it_trains(one_rank):
    # FSDP1 with use_orig_params=True keeps the parameter objects (their data becomes
    # views of the flat shard), so an earlier optimizer holds what the wrapped model trains.
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters())
    wrapped = annot.auto_wrap(model, "fsdp1")
    assert {id(p) for p in wrapped.parameters()} <= {id(p) for g in opt.param_groups for p in g["params"]}


def test_ddp_keeps_parameters_so_an_earlier_optimizer_is_allowed(one_rank):
    model = small_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = annot.auto_wrap(model, "ddp")
    assert {id(p) for p in wrapped.parameters()} == {id(p) for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize(
    ("engine", "options", "match"),
    [
        ("ddp", dict(offload=True), "no option 'offload'.*offload_activations=True"),
        ("ddp", dict(mesh=object()), "no option 'mesh'.*default process group"),
        ("fsdp1", dict(offload_activations=True), "no option 'offload_activations'.*'fsdp2' or 'ddp'"),
        ("fsdp2", dict(config={}), "no option 'config'.*engine='deepspeed'"),
        ("fsdp2", dict(leaf_modules=["MLP"]), "no option 'leaf_modules'"),
        ("deepspeed", dict(offload_activations=True), "cpu_checkpointing=True"),
    ],
)
def test_an_option_the_engine_cannot_honour_names_it_and_the_fix(one_rank, engine, options, match):
    factory = (lambda params: torch.optim.SGD(params, lr=0.1)) if engine == "deepspeed" else None
    with pytest.raises(TypeError, match=match):
        annot.auto_wrap(small_gpt(), engine, optimizer=factory, **options)


def test_options_may_be_given_as_the_engines_own_type(one_rank):
    model = annot.auto_wrap(small_gpt(), "fsdp2", options=annot.FSDP2Options(mixed_precision="bf16"))
    policy = model.transformer.h[0]._get_fsdp_state()._fsdp_param_group.mp_policy
    assert policy.param_dtype == torch.bfloat16
    with pytest.raises(TypeError, match="takes FSDP2Options, not DDPOptions"):
        annot.auto_wrap(small_gpt(), "fsdp2", options=annot.DDPOptions())


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "ddp"])
def test_torch_engines_refuse_nvme_offload(one_rank, engine):
    if engine != "ddp":  # DDP has no parameter offload option at all (see above)
        with pytest.raises(annot.EngineNotAvailableError, match="NVMe"):
            annot.auto_wrap(small_gpt(), engine, offload="nvme")
    model = small_gpt()
    annot.mark(model.transformer.h[1], offload="nvme")
    with pytest.raises(annot.EngineNotAvailableError, match="transformer.h.1"):
        annot.auto_wrap(model, engine)


def test_deepspeed_needs_an_optimizer_factory(one_rank):
    with pytest.raises(ValueError, match="optimizer="):
        annot.auto_wrap(small_gpt(), "deepspeed")


def test_fsdp2_mixed_precision_computes_in_bf16_and_reduces_in_fp32(one_rank):
    model = annot.auto_wrap(small_gpt(), "fsdp2", mixed_precision="bf16")
    policy = model.transformer.h[0]._get_fsdp_state()._fsdp_param_group.mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_a_plan_for_another_model_is_refused(one_rank):
    plan = annot.plan(GPT(n_layer=3, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    with pytest.raises(ValueError, match="transformer.h.2"):
        annot.auto_wrap(small_gpt(), "fsdp2", plan)


def test_fsdp1_refuses_offloading_only_some_units(one_rank):
    model = small_gpt()
    annot.mark(model.transformer.h[0], offload="cpu")
    with pytest.raises(annot.EngineNotAvailableError, match="all parameters or none"):
        annot.auto_wrap(model, "fsdp1")


def test_fsdp1_offload_on_cpu_is_refused_rather_than_crashing_in_torch(one_rank):
    with pytest.raises(annot.EngineNotAvailableError, match="FSDP1 parameter offload.*engine='fsdp2'"):
        annot.auto_wrap(small_gpt(), "fsdp1", offload=True, device="cpu")


def test_fsdp2_refuses_a_parameter_without_dimensions_by_name_before_changing_the_model(one_rank):
    """Moonshine-Streaming's ``log_k``: FSDP2 cannot shard it; torch's own error came
    from inside fully_shard, the model half sharded."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model.register_parameter("log_k", torch.nn.Parameter(torch.tensor(0.5)))
    with pytest.raises(annot.EngineNotAvailableError, match=r"log_k has no dimension.*engine='fsdp1'"):
        annot.auto_wrap(model, "fsdp2", annot.by_class(torch.nn.Linear))
    assert not any(hasattr(p, "placements") for p in model.parameters())


class Params4bit(torch.nn.Parameter):
    """Stands for bitsandbytes' 4-bit parameter (not installed here): the check reads the
    class's name and module only."""


Params4bit.__module__ = "bitsandbytes.nn.modules"


def test_fsdp2_refuses_bitsandbytes_parameters_naming_the_way_that_keeps_the_bytes(one_rank):
    """bitsandbytes' packed 4-bit weights under FSDP2 train silently wrong (bitsandbytes
    #1945): refused before the model changes, pointing at quantize='nf4'."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = Params4bit(torch.zeros(4, 4), requires_grad=False)
    with pytest.raises(annot.EngineNotAvailableError, match=r"1\.weight.*#1945.*quantize='nf4'"):
        annot.auto_wrap(model, "fsdp2", annot.by_class(torch.nn.Linear))
    assert not any(hasattr(p, "placements") for p in model.parameters())
