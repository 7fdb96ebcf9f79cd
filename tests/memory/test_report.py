"""`estimate_memory`: rows for every strategy, fits, and the recommendation's rules."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.memory import MemoryInputError
from examples.gpt.model import GPT

GiB = 2**30


def _gpt(**shape):
    with torch.device("meta"):
        return GPT(**shape)


@pytest.mark.slow
def test_small_model_that_fits_gets_ddp():
    report = annot.estimate_memory(_gpt(n_layer=2), gpus=8, batch=2, seq=32,
                                   gpu_mem=80 * GiB, host_mem=512 * GiB)
    assert report.recommendation == "ddp" and report.checkpoint is False
    assert "below ~500M parameters" in report.reason


@pytest.mark.slow
def test_above_500m_parameters_ddp_is_not_recommended_even_if_it_fits():
    model = _gpt(n_layer=12, n_embd=2048, n_head=16, vocab_size=50304, block_size=64)
    report = annot.estimate_memory(model, gpus=8, batch=1, seq=64, gpu_mem=80 * GiB, host_mem=512 * GiB)
    assert report.params > 500_000_000
    assert report.row("ddp").fits
    assert report.recommendation == "zero1"


@pytest.mark.slow
def test_tight_memory_moves_to_checkpointing_then_sharding_then_offload():
    model = _gpt(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, block_size=256)
    exact = dict(margin=0.0, reserve=0)  # compare counted peaks with the limit directly
    base = annot.estimate_memory(model, gpus=4, batch=8, seq=256, gpu_mem=80 * GiB, host_mem=64 * GiB, **exact)
    # Too tight for DDP, ZeRO-1 and ZeRO-2 without checkpointing, roomy for DDP with it:
    # recomputation is cheaper than sharding further.
    limit = min(base.row(k).gpu for k in ("ddp", "zero1", "zero2")) - 1
    assert base.row("ddp").gpu_checkpointed < limit
    squeezed = annot.estimate_memory(model, gpus=4, batch=8, seq=256, gpu_mem=limit, host_mem=64 * GiB, **exact)
    assert (squeezed.recommendation, squeezed.checkpoint) == ("ddp", True)
    # Below every GPU-resident strategy with checkpointing: offload.
    resident = min(r.gpu_checkpointed for r in base.rows if "offload" not in r.key)
    tiny = annot.estimate_memory(model, gpus=4, batch=8, seq=256, gpu_mem=resident - 1, host_mem=64 * GiB,
                                 **exact)
    assert "offload" in tiny.recommendation and tiny.checkpoint is True


@pytest.mark.slow
def test_host_memory_limits_offload():
    model = _gpt(n_layer=2)
    report = annot.estimate_memory(model, batch=1, seq=16, gpu_mem=1, host_mem=1)
    assert report.recommendation is None
    assert not any(r.fits_checkpointed for r in report.rows)


def test_report_table_and_dict():
    report = annot.estimate_memory(_gpt(n_layer=2), gpus=2, batch=1, seq=16, gpu_mem=4 * GiB, host_mem=GiB)
    text = report.table()
    assert "recommendation:" in text and "<-" in text
    data = report.to_dict()
    assert data["rows"][0]["key"] == "ddp" and data["precision"] == "bf16-mixed"


def test_bad_inputs():
    with pytest.raises(MemoryInputError, match="unknown precision"):
        annot.estimate_memory(_gpt(n_layer=1), precision="fp64")
    with pytest.raises(MemoryInputError, match="at least 1"):
        annot.estimate_memory(_gpt(n_layer=1), gpus=0)


def test_a_wrapped_model_is_refused():
    # Stands in for torch's DDP wrapper: the check goes by the wrapper classes' names.
    wrapper = type("DistributedDataParallel", (torch.nn.Module,), {})()
    wrapper.module = _gpt(n_layer=1)
    with pytest.raises(MemoryInputError, match="takes the bare model"):
        annot.estimate_memory(wrapper)


@pytest.mark.slow
def test_the_margin_and_reserve_decide_what_fits():
    model = _gpt(n_layer=2)
    counted = annot.estimate_memory(model, gpus=2, batch=1, seq=16, margin=0.0, reserve=0,
                                    gpu_mem=GiB, host_mem=GiB).row("ddp").gpu
    limit = int(counted * 1.1) + 1000
    assert annot.estimate_memory(model, gpus=2, batch=1, seq=16, margin=0.1, reserve=0,
                                 gpu_mem=limit, host_mem=GiB).row("ddp").fits
    assert not annot.estimate_memory(model, gpus=2, batch=1, seq=16, margin=0.1, reserve=2000,
                                     gpu_mem=limit, host_mem=GiB).row("ddp").fits


def test_the_recommendation_prints_its_auto_wrap_call():
    report = annot.estimate_memory(_gpt(n_layer=2), gpus=8, batch=2, seq=32, precision="bf16-mixed",
                                   gpu_mem=80 * GiB, host_mem=512 * GiB)
    assert 'annot.auto_wrap(model, "ddp", checkpoint=False) + torch.autocast' in report.table()


def test_engine_buffers_are_in_the_zero_rows():
    # A 1-unit reduce bucket is part of ZeRO-2's peak; DeepSpeed's own default (5e8
    # elements) would dwarf this model.
    report = annot.estimate_memory(_gpt(n_layer=2), gpus=2, batch=1, seq=16, precision="fp32",
                                   gpu_mem=GiB, host_mem=GiB)
    parts = report.row("zero2").detail.parts
    assert 0 < parts["reduce bucket"] < 2**20


@pytest.mark.slow
def test_a_transformers_moe_gets_every_row():
    # Qwen3-MoE: fused experts (grouped matmul under the fake trace in fp32 and bf16) and
    # a _tp_plan with styles annot does not apply (the TP layout is the one row left out).
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    common = dict(batch=1, seq=32, gpu_mem=80 * GiB, host_mem=64 * GiB)
    for precision in ("fp32", "bf16-mixed"):
        report = annot.estimate_memory(model, gpus=1, precision=precision, **common)
        assert report.recommendation == "ddp" and report.activations.saved > 0
    two_nodes = annot.estimate_memory(model, gpus=2, nodes=2, **common)
    assert [label for label, _ in two_nodes.unavailable] == ["TP 2 x FSDP2 2"]
    assert {"fsdp2", "zero3", "fsdp2-hsdp"} <= {r.key for r in two_nodes.rows}
