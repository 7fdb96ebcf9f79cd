"""Which dtype mixes each engine takes (annot/engines/dtypes.py), through `auto_wrap`'s
checks, which run before it asks for a process group: a refusal is the engine's
`EngineNotAvailableError`; an accepted model gets as far as the missing process group.

FSDP2 needs one dtype among each unit's trainable parameters, FSDP1 among all of a unit's,
DeepSpeed among all trainable parameters of the model; DDP takes anything. The 2-rank
runs of the accepted LoRA-on-bf16 model are in tests/finetune/test_finetune.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import annot
from examples.gpt.model import GPT

ENGINES = ("fsdp2", "fsdp1", "deepspeed", "ddp")


def gpt() -> GPT:
    return GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def frozen_bf16_mlp() -> GPT:
    """Block 0 holds a frozen bf16 MLP beside trainable fp32 attention."""
    model = gpt()
    model.transformer.h[0].mlp.to(torch.bfloat16).requires_grad_(False)
    return model


def trained_bf16_mlp() -> GPT:
    """Block 0 trains a bf16 MLP beside fp32 attention."""
    model = gpt()
    model.transformer.h[0].mlp.to(torch.bfloat16)
    return model


def trained_bf16_block() -> GPT:
    """Block 0 is bf16 and trains; every unit holds one dtype, the model trains two."""
    model = gpt()
    model.transformer.h[0].to(torch.bfloat16)
    return model


def lora_on_bf16() -> torch.nn.Module:
    pytest.importorskip("peft")
    from tests.finetune.cases import CASES

    return CASES["lora-bf16"][1]()


# model -> the engines that refuse it, and what their message says
REFUSALS = {
    frozen_bf16_mlp: {"fsdp1": "module `transformer.h.0` holds float32 (transformer.h.0.ln_1.weight, "
                               "transformer.h.0.ln_1.bias and 6 more) and bfloat16 "
                               "(transformer.h.0.mlp.c_fc.weight, transformer.h.0.mlp.c_fc.bias and 2 more)"},
    trained_bf16_mlp: {
        "fsdp2": "module `transformer.h.0` trains float32 (transformer.h.0.ln_1.weight, "
                 "transformer.h.0.ln_1.bias and 6 more) and bfloat16 (transformer.h.0.mlp.c_fc.weight",
        "fsdp1": "module `transformer.h.0` holds float32",
        "deepspeed": "GPT trains float32 (transformer.wte.weight, transformer.wpe.weight and 22 more) "
                     "and bfloat16 (transformer.h.0.mlp.c_fc.weight",
    },
    trained_bf16_block: {"deepspeed": "GPT trains float32 (transformer.wte.weight, "
                                      "transformer.wpe.weight and 14 more) and bfloat16"},
    lora_on_bf16: {"fsdp1": "module `base_model.model.model.layers.0` holds bfloat16"},
}
FIXES = {
    "fsdp2": "fsdp2 needs one dtype among the trainable parameters of each unit",
    "fsdp1": "fsdp1 flattens each unit into one FlatParameter of one dtype, frozen parameters "
             "included",
    "deepspeed": "deepspeed keeps all trainable parameters in flat buffers of one dtype",
}
CASES = [(build, engine) for build in REFUSALS for engine in ENGINES]


@pytest.mark.parametrize(("build", "engine"), CASES,
                         ids=[f"{b.__name__}-{e}" for b, e in CASES])
def test_each_engine_refuses_exactly_what_it_cannot_shard(build, engine):
    assert not dist.is_initialized()
    model = build()
    refused = REFUSALS[build].get(engine)
    if refused is None:  # accepted: auto_wrap goes on to ask for a process group
        with pytest.raises(annot.ProcessGroupNotInitializedError):
            annot.auto_wrap(model, engine)
        return
    with pytest.raises(annot.EngineNotAvailableError) as info:
        annot.auto_wrap(model, engine)
    message = str(info.value)
    assert FIXES[engine] in message and refused in message
    assert "cast" in message  # the fix


def test_a_plan_made_before_freezing_is_checked_against_the_model_as_it_is():
    # The engines read dtypes and requires_grad from the model when auto_wrap runs, not
    # from counts the Plan took earlier.
    model = trained_bf16_mlp()
    plan = annot.plan(model)
    with pytest.raises(annot.EngineNotAvailableError, match="fsdp2 needs one dtype"):
        annot.auto_wrap(model, "fsdp2", plan)
    model.transformer.h[0].mlp.requires_grad_(False)
    with pytest.raises(annot.ProcessGroupNotInitializedError):
        annot.auto_wrap(model, "fsdp2", plan)


def test_the_plan_warning_names_the_engines_that_take_the_unit():
    (frozen_mix,) = annot.plan(frozen_bf16_mlp()).warnings
    assert "FSDP1 flattens a unit into one dtype and refuses it; FSDP2, DeepSpeed and DDP train it" in frozen_mix
    (trained_mix,) = annot.plan(trained_bf16_mlp()).warnings
    assert "its trainable parameters are float32 and bfloat16: only DDP trains that" in trained_mix
