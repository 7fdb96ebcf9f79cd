"""QLoRA through `annot.from_pretrained(..., quantize="nf4")`: which linears are
quantized, the quantized bytes against torchao's quantization of transformers' own
weights, the refusals, and FSDP2 on 2 ranks against one process with the same
quantized model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import annot
from annot.quantization import choose_linears
from tests.distributed import ROOT, torchrun
from tests.quantization.cases import (
    BATCHES,
    LR,
    SEED,
    TOLERANCE,
    adapter_grads,
    lora,
    save_tiny_llama,
)
from tests.requires import installed

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
# Skipped test by test, not the module: every test file must collect alone
# (tests/test_collection.py), and CI's main run has no torchao (not in ".[all]").
pytestmark = installed("torchao")

WORKER = Path(__file__).with_name("qlora_worker.py")
EXAMPLE = ROOT / "examples" / "qlora" / "train.py"
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("qlora") / "llama")


def _lora_llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_frozen_block_linears_are_chosen_and_the_head_is_kept():
    chosen = choose_linears(_lora_llama(), shards=2)
    layer = "base_model.model.model.layers.0"
    assert set(chosen.quantized) == {
        f"{layer}.self_attn.q_proj.base_layer.weight", f"{layer}.self_attn.k_proj.weight",
        f"{layer}.self_attn.v_proj.weight", f"{layer}.self_attn.o_proj.weight",
        f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight", f"{layer}.mlp.down_proj.weight"}
    assert chosen.kept == {"base_model.model.lm_head.weight": "the output head"}
    assert not any(".lora_" in name for name in chosen.quantized)  # trainable: never quantized


def test_a_weight_that_does_not_split_into_whole_blocks_is_kept_with_the_reason():
    # k_proj and v_proj are 128 x 256: 32768 weights, 2 blocks of 64 x 256, so 4 ranks
    # would each hold half a block.
    chosen = choose_linears(_lora_llama(), shards=4)
    kept = chosen.kept["base_model.model.model.layers.0.self_attn.k_proj.weight"]
    assert kept == "128 x 256 does not split into whole blocks of 16384 weights on 4 ranks"
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in chosen.quantized
    assert "kept in the model's dtype" in chosen.describe()


def test_a_mixture_of_experts_router_is_kept():
    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(256, 256, bias=False)
            self.experts = nn.ModuleList([nn.Linear(256, 256, bias=False)])

    model = nn.Sequential(Moe()).requires_grad_(False)
    chosen = choose_linears(model)
    assert chosen.kept == {"0.gate.weight": "a mixture-of-experts router"}
    assert chosen.quantized == ("0.experts.0.weight",)


def test_fused_experts_of_a_mixture_of_experts_are_kept_and_said():
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                         moe_intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         num_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.Qwen3MoeForCausalLM(config),
                                    peft.LoraConfig(r=4, target_modules=["q_proj"]))
    chosen = choose_linears(model, shards=2)
    layer = "base_model.model.model.layers.0"
    # transformers 5's router is a module of its own (Qwen3MoeTopKRouter), not a linear.
    assert f"{layer}.mlp.gate.weight" not in chosen.quantized
    assert chosen.kept[f"{layer}.mlp.experts.gate_up_proj"].startswith("a stacked 3-D weight (fused experts)")
    assert f"{layer}.self_attn.o_proj.weight" in chosen.quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_bytes_are_torchaos_quantization_of_transformers_weights(llama_folder, dtype):
    """Each quantized weight holds, bitwise, ``to_nf4`` of the weight transformers loads
    (in the same dtype); everything else equals transformers' own load."""
    from torchao.quantization import to_nf4

    torch.manual_seed(SEED)
    model = annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4", torch_dtype=dtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, dtype=dtype).state_dict()
    quantized = 0
    for name, param in model.named_parameters():
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".lora_" in name:
            continue
        if hasattr(param, "quantized_data"):
            want = to_nf4(reference[key], 64, 256)
            for inner in INNER:
                assert torch.equal(getattr(param, inner), getattr(want, inner)), (name, inner)
            assert not param.requires_grad
            quantized += 1
        else:
            assert torch.equal(param.detach(), reference[key]), name
    assert quantized == 14  # 7 linears in each of 2 layers; the head is kept


def test_weights_are_quantized_unit_by_unit_as_the_engine_asks(llama_folder):
    """`CheckpointSource.fill_before_sharding` quantizes only what the modules it is given
    own, so a rank holds one unit's quantized weights whole at a time; the load fills
    the rest (`fill_before_load`)."""
    from annot.formats.choice import checkpoint_source
    from annot.huggingface.pretrained import build_pretrained
    from annot.quantization import quantize_on_load

    model = build_pretrained(llama_folder, peft_config=lora())
    source = quantize_on_load(model, checkpoint_source(model, llama_folder), choose_linears(model, 2))
    layers = model.base_model.model.model.layers

    def quantized(module: nn.Module) -> int:
        return sum(hasattr(p, "quantized_data") for p in module.parameters())

    assert source.fill_before_sharding is not None
    source.fill_before_sharding([layers[0]])
    assert (quantized(layers[0]), quantized(layers[1])) == (7, 0)
    assert all(p.is_meta for p in layers[1].parameters())
    source.fill_before_load(model)
    assert (quantized(layers[0]), quantized(layers[1])) == (7, 7)
    assert len(source.filled) == 14


def test_refusals_name_the_way_out(llama_folder, tmp_path):
    with pytest.raises(ValueError, match="annot quantizes to 'nf4'"):
        annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="int3")
    for engine in ("fsdp1", "deepspeed", "ddp"):
        with pytest.raises(ValueError, match=f"{engine!r} is not built for a quantized base yet"):
            annot.from_pretrained(llama_folder, engine, peft_config=lora(), quantize="nf4")
    with pytest.raises(ValueError, match="mmap=True"):
        annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4", mmap=True)
    with pytest.raises(ValueError, match="freeze the base with peft_config"):
        annot.from_pretrained(llama_folder, None, quantize="nf4")


def test_a_load_leaves_the_tensors_it_is_told_are_filled(llama_folder):
    """The loader's ``filled`` (a `CheckpointSource`'s, after quantizing on load): those
    tensors are neither read, nor initialized, nor reported missing."""
    from annot.checkpoint_io.loading import load

    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(llama_folder))
    name = "model.layers.0.mlp.up_proj.weight"
    marker = torch.full_like(model.get_parameter(name), 3.0)
    with torch.no_grad():
        model.get_parameter(name).copy_(marker)
    report = load(model, llama_folder, filled={name})
    assert torch.equal(model.get_parameter(name), marker)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_folder).state_dict()
    assert torch.equal(model.get_parameter("model.layers.0.mlp.down_proj.weight"),
                       reference["model.layers.0.mlp.down_proj.weight"])
    assert report.missing == ()


def _one_process(folder: Path) -> dict:
    """The reference: the same quantized model unwrapped, trained on both ranks' rows
    (the mean of the two per-rank losses, as FSDP2 averages the ranks' gradients)."""
    torch.manual_seed(SEED)
    model = annot.from_pretrained(folder, None, peft_config=lora(), quantize="nf4").train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], []
    for tokens in BATCHES:
        halves = [model(input_ids=rows, labels=rows).loss for rows in tokens.split(2)]
        loss = (halves[0] + halves[1]) / 2
        loss.backward()
        grads.append(adapter_grads(model))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [
    (),
    # The default lane keeps the plain run (each launch about 25 s on 2 cores; the lane
    # must stay under 20 minutes); the sweep lane adds checkpointing and offload.
    pytest.param(("checkpoint",), marks=pytest.mark.sweep),
    pytest.param(("offload",), marks=pytest.mark.sweep),
], ids=["plain", "checkpoint", "offload"])
def test_fsdp2_on_two_ranks_trains_like_one_process(llama_folder, tmp_path, flags):
    out = tmp_path / "out.pt"
    torchrun(WORKER, str(out), str(llama_folder), *flags)
    got, want = torch.load(out), _one_process(llama_folder)
    assert got["quantized"] == 14
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=TOLERANCE, atol=0)
    for step, (got_grads, want_grads) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=TOLERANCE, atol=TOLERANCE,
                                       msg=lambda m, n=name, s=step: f"step {s}, {n}: {m}")
    # Every adapter trains (B is drawn, not zero: both A and B get gradients at once).
    assert len(want["grads"][0]) == 2 * 14 and all(g.abs().sum() > 0 for g in want["grads"][0].values())


def _example_losses(nproc: int) -> list[float]:
    proc = torchrun(EXAMPLE, "--steps", "4", nproc=nproc)
    return [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", proc.stdout, re.M)]


@pytest.mark.distributed
@pytest.mark.sweep  # two launches, about 40 s: the 2-rank equality runs in the default lane above
def test_the_example_prints_the_same_losses_on_one_and_two_ranks():
    one, two = _example_losses(1), _example_losses(2)
    assert len(one) == 4
    assert one[-1] < one[0]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=0, atol=1e-6)


def test_the_example_says_what_it_does():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, check=True)
    assert "--steps" in out.stdout and "--model" in out.stdout
