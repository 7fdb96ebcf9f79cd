"""QLoRA through `annot.from_pretrained(..., quantize="nf4")`: which linears are
quantized, the quantized bytes against torchao's quantization of transformers' own
weights, the refusals, and FSDP2 on 2 ranks against one process with the same
quantized model."""

from __future__ import annotations

import json
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
    PROBE,
    RESUME_AT,
    SEED,
    TOLERANCE,
    adapter_grads,
    lora,
    quantized_digest,
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
    for engine in ("fsdp1", "deepspeed"):
        with pytest.raises(ValueError, match=f"{engine!r} is not built for a quantized base yet"):
            annot.from_pretrained(llama_folder, engine, peft_config=lora(), quantize="nf4")
    with pytest.raises(ValueError, match="mmap=True"):
        annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4", mmap=True)
    with pytest.raises(ValueError, match="freeze the base with peft_config"):
        annot.from_pretrained(llama_folder, None, quantize="nf4")


def test_a_dtype_cast_of_a_quantized_model_is_refused_and_a_device_move_is_not(llama_folder):
    """torchao's NF4 answers a cast with its dense dequantized weight: ``model.to(dtype)``
    would swap every 4-bit weight for a dense one and train on."""
    model = annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4")
    for cast in (lambda: model.to(torch.bfloat16), lambda: model.to("cpu", torch.float16),
                 lambda: model.to(dtype=torch.float64), model.half, model.bfloat16, model.float):
        with pytest.raises(TypeError, match="dense dequantized copy.*torch_dtype="):
            cast()
    assert model.to("cpu") is model
    assert sum(_is_nf4(p) for p in model.parameters()) == 14


def _is_nf4(tensor: torch.Tensor) -> bool:
    return type(getattr(tensor, "_local_tensor", tensor)).__name__ == "NF4Tensor"


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


def _assert_trains_like_one_process(got: dict, want: dict, quantized: int = 14, adapted: int = 14) -> None:
    assert got["quantized"] == quantized
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=TOLERANCE, atol=0)
    for step, (got_grads, want_grads) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=TOLERANCE, atol=TOLERANCE,
                                       msg=lambda m, n=name, s=step: f"step {s}, {n}: {m}")
    # Every adapter trains (B is drawn, not zero: both A and B get gradients at once).
    assert len(want["grads"][0]) == 2 * adapted and all(g.abs().sum() > 0 for g in want["grads"][0].values())


@pytest.fixture(scope="module")
def two_ranks(llama_folder, tmp_path_factory) -> tuple[Path, dict]:
    """One 2-rank launch of the plain run that also saves a training state after
    `RESUME_AT` steps, exports the adapters and the merged model, and resumes
    (qlora_worker.py): its folder and what rank 0 returned."""
    folder = tmp_path_factory.mktemp("qlora-two-ranks")
    torchrun(WORKER, str(folder / "out.pt"), str(llama_folder), f"save={folder}")
    return folder, torch.load(folder / "out.pt")


@pytest.mark.distributed
def test_fsdp2_on_two_ranks_trains_like_one_process(llama_folder, two_ranks):
    _assert_trains_like_one_process(two_ranks[1], _one_process(llama_folder))


@pytest.mark.distributed
@pytest.mark.sweep  # each launch about 25 s on 2 cores; the plain run is in the default lane
@pytest.mark.parametrize("flags", [("checkpoint",), ("offload",)], ids=["checkpoint", "offload"])
def test_fsdp2_on_two_ranks_trains_like_one_process_checkpointed_or_offloaded(llama_folder, tmp_path, flags):
    out = tmp_path / "out.pt"
    torchrun(WORKER, str(out), str(llama_folder), *flags)
    _assert_trains_like_one_process(torch.load(out), _one_process(llama_folder))


@pytest.mark.distributed
@pytest.mark.sweep  # one launch, about 25 s; the default lane keeps the FSDP2 run
def test_ddp_on_two_ranks_trains_like_one_process_each_rank_holding_the_whole_quantized_base(
        llama_folder, tmp_path):
    """DDP replicates the quantized base: each rank quantizes every weight whole (no rows
    split off), DDP's broadcast at wrap leaves the packed bytes as they were (each rank's
    equal to one process's quantization), and only the adapters' gradients are reduced."""
    out = tmp_path / "out.pt"
    torchrun(WORKER, str(out), str(llama_folder), "ddp", "checkpoint")
    got = torch.load(out)
    _assert_trains_like_one_process(got, _one_process(llama_folder))
    torch.manual_seed(SEED)
    whole = quantized_digest(annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4"))
    assert len(whole) == 14 and got["digests"] == [whole, whole]


@pytest.mark.distributed
@pytest.mark.sweep  # one launch, about 30 s; the default lane keeps the Llama run
def test_a_mixture_of_experts_trains_on_two_ranks_like_one_process(tmp_path):
    """Qwen3-MoE: the attention projections quantized (8 weights) and adapted; the fused
    experts (3-D) and the router stay in fp32, frozen, the experts' two stacked weights
    adapted too (PEFT maps ``gate_proj``/``down_proj`` onto them: 4 more adapters)."""
    folder = save_tiny_llama(tmp_path / "qwen3-moe", moe=True)
    out = tmp_path / "out.pt"
    torchrun(WORKER, str(out), str(folder))
    _assert_trains_like_one_process(torch.load(out), _one_process(folder), quantized=8, adapted=12)


@pytest.mark.distributed
def test_a_resumed_run_trains_like_the_uninterrupted_one(two_ranks):
    """save_state after 3 steps, a model built with other adapters, load_state: the
    remaining steps' losses are the uninterrupted run's (the base is rebuilt from the
    checkpoint and quantized again, the adapters and AdamW's state come back)."""
    folder, got = two_ranks
    assert len(got["resumed"]) == len(BATCHES) - RESUME_AT
    torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["losses"][RESUME_AT:]),
                               rtol=TOLERANCE, atol=0)
    state = json.loads((folder / "state" / f"step-{RESUME_AT:08d}" / "trainer_state.json").read_text())
    assert state["quantized_base"]["format"] == "nf4" and len(state["quantized_base"]["weights"]) == 14


def _quantized_by_hand(model: nn.Module, names: list[str]) -> None:
    """torchao's ``to_nf4`` of each named weight in place, as a user quantizes for QLoRA."""
    from torchao.quantization import to_nf4

    for name in names:
        path, _, attribute = name.rpartition(".")
        owner = model.get_submodule(path)
        setattr(owner, attribute, nn.Parameter(to_nf4(getattr(owner, attribute).detach(), 64, 256),
                                               requires_grad=False))


@pytest.mark.distributed
def test_the_adapter_export_loads_in_peft_onto_the_base_quantized_alike(llama_folder, two_ranks):
    """``PeftModel.from_pretrained`` of the exported adapters on transformers' model of
    the checkpoint, its quantized weights (as the training state lists them) quantized
    by hand with torchao: the QLoRA model's logits (fp32, 1e-5)."""
    folder, got = two_ranks
    assert sorted(p.name for p in (folder / "adapter").iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    model = peft.PeftModel.from_pretrained(base, folder / "adapter").eval()
    state = json.loads((folder / "state" / f"step-{RESUME_AT:08d}" / "trainer_state.json").read_text())
    _quantized_by_hand(model, state["quantized_base"]["weights"])
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    torch.testing.assert_close(logits, got["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_the_merged_export_gives_the_qlora_models_logits(two_ranks):
    """The merged export (each quantized weight dequantized, the LoRA update added)
    loads in transformers and gives the QLoRA model's logits: in fp32 within 1e-5
    (measured 1.4e-6), in bf16 (every tensor the fp32 export's, rounded) within 2e-2 of
    logits of about 1.4 (measured 1.4e-2: bf16's rounding of every weight)."""
    folder, got = two_ranks
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / "merged").eval()
    assert not any(".lora_" in name or "base_layer" in name for name in merged.state_dict())
    with torch.no_grad():
        logits = merged(input_ids=PROBE).logits
    torch.testing.assert_close(logits, got["logits"], rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    fp32, bf16 = (load_file(folder / name / "model.safetensors") for name in ("merged", "merged-bf16"))
    assert fp32.keys() == bf16.keys()
    for name, tensor in fp32.items():
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name
    rounded = transformers.AutoModelForCausalLM.from_pretrained(folder / "merged-bf16",
                                                                dtype=torch.float32).eval()
    with torch.no_grad():
        logits = rounded(input_ids=PROBE).logits
    torch.testing.assert_close(logits, got["logits"], rtol=0, atol=2e-2)


def test_a_state_of_a_quantized_base_is_refused_by_a_model_quantized_otherwise(llama_folder, tmp_path):
    """A state saved from a QLoRA model and loaded into the same model unquantized: the
    adapters were trained against other weights, so the load says so before reading."""
    torch.manual_seed(SEED)
    model = annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    saved = annot.save_state(tmp_path, annot.Trainable(model, model, optimizer, "local"), step=0)
    state = json.loads((saved / "trainer_state.json").read_text())
    assert not any("base_layer.weight" in key and "proj" in key
                   for key in _saved_keys(saved)), "the quantized weights are rebuilt, not saved"
    assert len(state["quantized_base"]["weights"]) == 14
    plain = annot.from_pretrained(llama_folder, None, peft_config=lora())
    plain_optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR)
    with pytest.raises(annot.CheckpointError, match="with a quantized base, and this model has none"):
        annot.load_state(saved, annot.Trainable(plain, plain, plain_optimizer, "local"))


def _saved_keys(folder: Path) -> set[str]:
    from annot.checkpoint_io.dcp_metadata import read_metadata

    return set(read_metadata(folder).state_dict_metadata)


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


MEMORY_WORKER = Path(__file__).with_name("memory_worker.py")


@pytest.mark.distributed
@pytest.mark.sweep  # one launch, about 20 s: the default lane stays under 20 minutes
def test_the_planner_prices_a_qlora_step_as_counted_on_two_ranks(llama_folder, tmp_path):
    """``estimate_memory(..., quantize="nf4")``'s FSDP2 row against the peak of live
    tensor bytes counted on each of 2 CPU ranks over 3 AdamW steps (memory_worker.py),
    4 sequences of 128 tokens per rank, fp32, plain and checkpointed, FSDP2 and DDP: each
    within 5% (measured -0.02%, +0.005%, +0.04%, +0.005%; FSDP2's checkpointed row read
    +14.9% while the trace left the key/value cache on inside PEFT's wrapper and gave a
    unit's recomputation to the stretch before it)."""
    batch, seq = 4, 128
    torchrun(MEMORY_WORKER, str(tmp_path / "out.pt"), str(llama_folder), str(batch), str(seq))
    counted = torch.load(tmp_path / "out.pt")
    config = transformers.AutoConfig.from_pretrained(llama_folder)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), lora())
    report = annot.estimate_memory(model, gpus=2, batch=batch, seq=seq, precision="fp32", quantize="nf4")
    rows = {row.key: row for row in report.rows}
    assert set(rows) == {"ddp", "fsdp2-no-reshard", "fsdp2", "fsdp2-offload"}
    assert any("NF4" in said for said in report.assumptions)
    torchrun(MEMORY_WORKER, str(tmp_path / "ddp.pt"), str(llama_folder), str(batch), str(seq), "ddp")
    counted_ddp = torch.load(tmp_path / "ddp.pt")
    for key, count in (("fsdp2", counted), ("ddp", counted_ddp)):
        plain = rows[key].detail.combined / max(count["plain"]) - 1
        checkpointed = rows[key].detail_checkpointed.combined / max(count["checkpoint"]) - 1
        assert abs(plain) <= 0.05, f"{key}, plain: planner {plain:+.2%} off the counted peak"
        assert abs(checkpointed) <= 0.05, f"{key}, checkpointed: planner {checkpointed:+.2%} off the counted peak"
    # --budget prices the same base: its answer with every block plain, and with every
    # block checkpointed, each within 5% of its count.
    from annot.memory.budget import budget_solver

    for choice, count in (("none", counted["plain"]), ("checkpoint", counted["checkpoint"])):
        solver = budget_solver(model, gpus=2, batch=batch, seq=seq, precision="fp32", strategies=["fsdp2"],
                               device="cpu", margin=0.0, reserve=0, choices=(choice,), quantize="nf4")
        answer = solver.fit(4 * max(counted["plain"]))
        assert set(answer.blocks.values()) == {choice}, answer.blocks
        assert abs(answer.peak_bytes / max(count) - 1) <= 0.05, (choice, answer.peak_bytes, count)
        assert 'quantize="nf4"' in answer.call and "policy=plan" in answer.call


def test_the_planner_counts_torchaos_nf4_bytes():
    """What a quantized weight holds and its dequantization's peak, counted on torchao:
    about 0.516 bytes a weight stored; dequantizing passes through int64 indices."""
    from annot.memory.quantized_base import nf4_costs

    for dtype in (torch.float32, torch.bfloat16):
        costs = nf4_costs(dtype)
        assert 0.5 < costs.stored < 0.52
        assert costs.dequantize > dtype.itemsize  # more than the dense weight it makes


def test_annot_plan_says_which_linears_a_quantized_base_holds_and_prices_them(llama_folder, capsys):
    """``annot plan DIR --lora R --quantize nf4``: the Plan, then which linears would be
    quantized on the ranks; with ``--memory`` the FSDP2 rows priced with NF4 bytes and
    the ``from_pretrained`` call that trains the recommended one."""
    from annot.cli.main import main

    assert main(["plan", str(llama_folder), "--lora", "4", "--quantize", "nf4", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: on 2 ranks (--gpus x --nodes), quantized to NF4: 14 linear weights" in out
    assert "lm_head.weight (the output head)" in out
    # The Plan's column: each block's 7 block linears (589,824 weights), nothing in the root.
    header, *rows = [line for line in out.splitlines() if "LlamaDecoderLayer" in line or "trainable" in line]
    column = header.split().index("quantized")
    assert [row.split()[column] for row in rows] == ["589.8K", "589.8K"]
    assert main(["plan", str(llama_folder), "--lora", "4", "--quantize", "nf4", "--json"]) == 0
    plan = annot.Plan.from_dict(json.loads(capsys.readouterr().out))
    assert [unit.quantized for unit in plan.units] == [589_824, 589_824] and plan.root.quantized == 0
    assert main(["plan", str(llama_folder), "--lora", "4", "--quantize", "nf4", "--memory", "--gpus", "2",
                 "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 + CPU offload" in out and "DDP" in out and "ZeRO" not in out
    assert 'quantize="nf4"' in out and "14 linear weights in NF4" in out
    assert main(["plan", str(llama_folder), "--quantize", "nf4"]) == 2
    assert "add --lora RANK" in capsys.readouterr().err
    # --budget weighs the DDP and FSDP2 strategies alone and answers with a from_pretrained call.
    assert main(["plan", str(llama_folder), "--lora", "4", "--quantize", "nf4", "--memory", "--gpus", "2",
                 "--seq", "16", "--budget", "1GiB", "--reserve", "0", "--device", "cpu", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    # (FSDP2 + offload is weighed where the device has a host link; the cpu device has none.)
    assert {fit["key"] for fit in answer["strategies"]} == {"ddp", "fsdp2-no-reshard", "fsdp2"}
    assert re.match(r'annot.from_pretrained\(DIR, "(ddp|fsdp2)", peft_config=..., quantize="nf4"', answer["call"])


def test_a_resume_names_what_differs_in_the_quantized_base(tmp_path):
    """Another block size, or other weights quantized (another world size splits other
    weights into whole blocks): refused, each difference named."""
    from annot.training_state import _check_quantized_base

    saved = {"format": "nf4", "block_size": 64, "scaler_block_size": 256, "dtype": "bfloat16",
             "weights": ["a.weight", "b.weight"]}
    _check_quantized_base(tmp_path, saved, dict(saved))
    other = {**saved, "block_size": 32, "weights": ["a.weight", "c.weight"]}
    with pytest.raises(annot.CheckpointError, match=r"block_size: saved 64, now 32.*1 only in the saved "
                                                    r"run \(b\.weight\), 1 only in this one \(c\.weight\)"):
        _check_quantized_base(tmp_path, saved, other)
    with pytest.raises(annot.CheckpointError, match="without a quantized base, and this model has one"):
        _check_quantized_base(tmp_path, None, saved)


def test_a_rule_keeps_chosen_linears_in_the_models_dtype(llama_folder):
    """``unquantized=``: the linears inside the modules a rule selects (PEFT's
    ``base_layer`` inside the selected ``o_proj``) stay as transformers loads them."""
    model = annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4",
                                  unquantized=annot.by_name("**.o_proj"))
    weights = dict(model.named_parameters())
    names = [name for name in weights if name.endswith("base_layer.weight")]
    assert sum(_is_nf4(weights[name]) for name in names) == 12
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_folder).state_dict()
    for layer in (0, 1):
        kept = weights[f"base_model.model.model.layers.{layer}.self_attn.o_proj.base_layer.weight"]
        assert not _is_nf4(kept)
        assert torch.equal(kept, reference[f"model.layers.{layer}.self_attn.o_proj.weight"])
    same = annot.from_pretrained(llama_folder, None, peft_config=lora(), quantize="nf4",
                                 unquantized="name:**.o_proj")  # the rule's text, as annot plan takes it
    assert sum(_is_nf4(p) for p in same.parameters()) == 12
    with pytest.raises(ValueError, match="pass quantize='nf4' too"):
        annot.from_pretrained(llama_folder, None, peft_config=lora(), unquantized="name:**.o_proj")


def test_the_planner_gathers_a_quantized_base_in_its_packed_bytes(llama_folder):
    """FSDP2's all-gathers of a quantized base move NF4's bytes (about 0.516 a weight),
    not the compute dtype's: the forward all-gather of the 14 quantized weights (2 x
    589,824 weights) is smaller by exactly their elements x (4 - 0.516) bytes in fp32."""
    from annot.memory.quantized_base import nf4_costs

    config = transformers.AutoConfig.from_pretrained(llama_folder)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), lora())

    def gathered(**options) -> int:
        report = annot.estimate_memory(model, gpus=2, batch=1, seq=16, precision="fp32", **options)
        row = {r.key: r for r in report.rows}["fsdp2"]
        assert row.time is not None
        return next(c.size for c in row.time.comm.collectives if c.what == "parameters, forward")

    saved = 2 * 589_824 * (4 - nf4_costs(torch.float32).stored)
    assert gathered() - gathered(quantize="nf4") == round(saved)
