"""`annot.memory.communication`: ring byte counts, placement on nodes, each engine's
collectives on hand-computed small cases, and the step time in `estimate_memory`."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import annot
from annot.memory import MemoryInputError
from annot.memory.communication import (
    Collective,
    Dtypes,
    Layout,
    Network,
    ParamRecord,
    ring_bytes,
    step_collectives,
    step_communication,
    tp_styles,
)
from annot.memory.counting import FlopCount
from examples.gpt.model import GPT

GiB = 2**30

# Two units and a root: unit 0 a (6, 4) weight, unit 1 a (5, 4) weight, the root a (3,)
# bias. Sizes below are worked out by hand from the rules in the module docstring.
RECORDS = (ParamRecord(0, "a", "weight", (6, 4), True), ParamRecord(1, "b", "weight", (5, 4), True),
           ParamRecord(-1, "", "bias", (3,), True))
FSDP = Dtypes(gather=2, reduce=4, activation=2)
ZERO = Dtypes(gather=2, reduce=2, activation=2)


def by_op_dim(collectives):
    found: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        found.setdefault((c.op, c.dim), []).append(c.size)
    return found


def test_ring_counts():
    assert ring_bytes("all-gather", 800, 8) == 700
    assert ring_bytes("reduce-scatter", 800, 8) == 700
    assert ring_bytes("all-reduce", 800, 8) == 1400
    assert ring_bytes("all-reduce", 800, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("broadcast", 1, 2)


def test_groups_land_on_nodes_tp_innermost():
    assert Layout(shard=64).span("shard", 8) == (8, 8)
    hsdp = Layout(replicate=8, shard=8)
    assert hsdp.span("shard", 8) == (8, 1) and hsdp.span("replicate", 8) == (1, 8)
    tp = Layout(shard=8, tp=8)
    assert tp.span("tp", 8) == (8, 1) and tp.span("shard", 8) == (1, 8)
    assert Layout(replicate=2, shard=16).span("shard", 8) == (8, 2)  # a shard group of two nodes


def test_bytes_and_seconds_inside_and_across_nodes():
    net = Network(gpus_per_node=8, nodes=2, intra_node_bw=100, inter_node_bw=10)
    # Flat all-gather of 1600 B over 16 ranks: each sends 1500 B; 2 of the ring's 16 links
    # cross nodes, so 187.5 B per rank on average, 1500 B leaving each node.
    flat = step_communication([Collective("all-gather", "p", "shard", 16, 1600)], Layout(shard=16), net)
    assert (flat.intra, flat.inter) == (1312, 188)
    assert flat.seconds == pytest.approx(max(1500 / 100, 8 * 187.5 / 10))
    assert flat.inter_seconds == flat.seconds
    # HSDP's all-reduce of 800 B over 2 ranks one node apart: 800 B per rank cross, the
    # node's 8 ranks share its link.
    hsdp = step_communication([Collective("all-reduce", "g", "replicate", 2, 800)],
                              Layout(replicate=2, shard=8), net)
    assert (hsdp.intra, hsdp.inter) == (0, 800)
    assert hsdp.seconds == pytest.approx(8 * 800 / 10)
    # Inside one node only the GPU's own link counts.
    node = step_communication([Collective("reduce-scatter", "g", "shard", 8, 800)],
                              Layout(replicate=2, shard=8), net)
    assert (node.intra, node.inter, node.inter_seconds) == (700, 0, 0.0)
    assert node.seconds == pytest.approx(7)
    with pytest.raises(MemoryInputError, match="has 8 ranks, the machines 16"):
        step_communication([], Layout(shard=8), net)


def test_fsdp2_gathers_each_unit_twice_the_root_once_and_pads_rows():
    found = by_op_dim(step_collectives("fsdp2", stage=3, records=RECORDS, layout=Layout(shard=4),
                                       dtypes=FSDP))
    # Shards padded to ceil(dim0/4) rows: 8 + 8 + 1 elements; gathers 4 x that in bf16.
    assert found[("all-gather", "shard")] == [4 * (8 + 8 + 1) * 2, 4 * (8 + 8) * 2]
    assert found[("reduce-scatter", "shard")] == [4 * 17 * 4]
    no_reshard = by_op_dim(step_collectives("fsdp2", stage=2, records=RECORDS, layout=Layout(shard=4),
                                            dtypes=FSDP))
    assert no_reshard[("all-gather", "shard")] == [4 * 17 * 2]


def test_hsdp_adds_the_shard_sized_all_reduce_and_frozen_weights_are_not_reduced():
    frozen = (RECORDS[0], ParamRecord(1, "b", "weight", (5, 4), False), RECORDS[2])
    found = by_op_dim(step_collectives("fsdp2", stage=3, records=frozen,
                                       layout=Layout(replicate=2, shard=4), dtypes=FSDP))
    assert found[("reduce-scatter", "shard")] == [4 * (8 + 1) * 4]
    assert found[("all-reduce", "replicate")] == [(8 + 1) * 4]


def test_fsdp1_flat_parameters_padded_to_the_group():
    found = by_op_dim(step_collectives("fsdp1", stage=3, records=RECORDS,
                                       layout=Layout(replicate=2, shard=4), dtypes=FSDP))
    assert found[("all-gather", "shard")] == [(24 + 20 + 4) * 2, (24 + 20) * 2]
    assert found[("reduce-scatter", "shard")] == [48 * 4]
    assert found[("all-reduce", "replicate")] == [48 // 4 * 4]


def test_zero_stages_and_hpz():
    ddp = by_op_dim(step_collectives("ddp", stage=0, records=RECORDS, layout=Layout(shard=4), dtypes=FSDP))
    assert ddp == {("all-reduce", "world"): [47 * 4]}
    zero2 = by_op_dim(step_collectives("deepspeed", stage=2, records=RECORDS, layout=Layout(shard=4),
                                       dtypes=ZERO))
    assert zero2 == {("all-reduce", "world"): [47 * 2], ("all-gather", "world"): [48 * 2]}
    # Persistence threshold 4: the bias stays whole and is gathered after the step.
    zero3 = by_op_dim(step_collectives("deepspeed", stage=3, records=RECORDS, layout=Layout(shard=4),
                                       dtypes=ZERO, persistence_threshold=4))
    assert zero3 == {("all-gather", "world"): [44 * 2, 44 * 2, 4 * 2],
                     ("reduce-scatter", "world"): [48 * 2]}
    hpz = by_op_dim(step_collectives("deepspeed", stage=3, records=RECORDS,
                                     layout=Layout(replicate=2, shard=2), dtypes=ZERO,
                                     persistence_threshold=4, hpz=2))
    assert hpz[("all-gather", "shard")] == [44 * 2]  # backward, inside the hpZ group
    assert hpz[("all-gather", "world")] == [44 * 2, 4 * 2]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.o_proj = nn.Linear(8, 8, bias=False)


def test_tensor_parallel_activations_and_local_shards():
    model = nn.Sequential(Attention())
    styles = tp_styles(model)
    assert styles == {"0.q_proj": "colwise", "0.o_proj": "rowwise"}
    assert tp_styles(model, {"*.q_proj": "colwise"}) == {"0.q_proj": "colwise"}
    records = (ParamRecord(0, "0.q_proj", "weight", (8, 8), True),
               ParamRecord(0, "0.o_proj", "weight", (8, 8), True))
    layout = Layout(shard=2, tp=2)
    found = by_op_dim(step_collectives("fsdp2", stage=3, records=records, layout=layout, dtypes=FSDP,
                                       tp=(model, styles, 10, set())))
    # q keeps 4 rows, o 4 columns; FSDP2 shards each over 2: 2 x 8 and 4 x 4 elements.
    assert found[("all-gather", "shard")][0] == 2 * (16 + 16) * 2
    # o_proj's output in forward, q_proj's input gradient in backward: 10 tokens x 8 x bf16.
    assert found[("all-reduce", "tp")] == [160, 160]
    again = by_op_dim(step_collectives("fsdp2", stage=3, records=records, layout=layout, dtypes=FSDP,
                                       tp=(model, styles, 10, {"0"})))
    assert again[("all-reduce", "tp")] == [320, 160]  # recomputation repeats the forward one
    with pytest.raises(MemoryInputError, match="does not apply"):
        tp_styles(model, {"*.q_proj": "packed_colwise"})
    with pytest.raises(MemoryInputError, match="FSDP2 only"):
        step_collectives("deepspeed", stage=3, records=records, layout=layout, dtypes=FSDP)


def test_flop_count_equals_torchs_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    x = torch.zeros(2, 16, dtype=torch.long)
    with FlopCounterMode(display=False) as reference:
        model(x, x)[1].backward()
    with FlopCount() as ours:
        model(x, x)[1].backward()
    # torch's counter misses the CPU attention kernel: per block, q @ k^T and scores @ v
    # forward, 5/2 of that backward (torch's flash formulas); B=2, heads=2, T=16, d=16.
    forward = 2 * (2 * 2 * 2 * 16 * 16 * 16)
    assert reference.get_total_flops() > 0
    assert ours.total == reference.get_total_flops() + 2 * (forward + 5 * forward // 2)


def _gpt(**shape):
    with torch.device("meta"):
        return GPT(**shape)


@pytest.mark.slow
def test_two_nodes_weigh_two_dimensional_layouts_and_a_slow_link_picks_one():
    model = _gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32)
    common = dict(gpus=4, nodes=2, batch=1, seq=32, gpu_mem=80 * GiB, host_mem=64 * GiB)
    slow = annot.estimate_memory(model, inter_node_bw=1, **common)
    keys = {r.key for r in slow.rows}
    assert {"fsdp2-hsdp", "fsdp1-hybrid", "zero3-hpz", "tp-fsdp2"} <= keys
    assert slow.recommendation in ("fsdp2-hsdp", "fsdp1-hybrid", "zero3-hpz", "tp-fsdp2")
    assert "the inter-node link binds" in slow.reason
    assert slow.call is not None and ("mesh=init_device_mesh" in slow.call or "hpz_partition_size=4" in slow.call)
    hsdp, flat = slow.row("fsdp2-hsdp"), slow.row("fsdp2")
    assert hsdp.time.comm.inter < flat.time.comm.inter and hsdp.time.overlapped < flat.time.overlapped
    # HSDP's memory is its shard group's: FSDP2 on 4 ranks.
    one_node = annot.estimate_memory(model, **{**common, "nodes": 1})
    assert hsdp.gpu == one_node.row("fsdp2").gpu
    assert not any(r.key == "fsdp2-hsdp" for r in one_node.rows)
    fast = annot.estimate_memory(model, inter_node_bw=1e6, intra_node_bw=1e6, **common)
    assert fast.recommendation == "ddp" and "inter-node" not in fast.reason
    assert "network: 1e+06 GB/s per GPU inside a node" in fast.table()


@pytest.mark.slow
def test_step_time_counts_the_traced_flops():
    model = _gpt(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    report = annot.estimate_memory(model, gpus=2, batch=2, seq=64, gpu_mem=80 * GiB,
                                   host_mem=64 * GiB, tflops=1.0)
    t = report.row("ddp").time
    # At least the 6 x parameters x tokens of the matmuls (attention adds more).
    assert t.flops >= 6 * report.params * 2 * 64
    assert t.compute == pytest.approx(t.flops / 1e12)
    assert t.tokens == 2 * 64 * 2
    assert report.row("ddp").time_checkpointed.flops > t.flops  # recomputation


def _gpt_with_tp_plan(plan: dict[str, str]) -> GPT:
    model = _gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=32)
    model._tp_plan = plan  # as transformers models carry theirs
    return model


@pytest.mark.slow
def test_a_tp_plan_annot_cannot_apply_marks_the_tp_row_unavailable_not_the_table():
    # Qwen3's _tp_plan asks for replicated_with_grad_allreduce on its q/k norms: the
    # other layouts are still weighed, the TP row says why it is missing.
    model = _gpt_with_tp_plan({"transformer.h.*.attn.c_attn": "colwise",
                               "transformer.h.*.ln_1": "replicated_with_grad_allreduce"})
    common = dict(batch=1, seq=32, gpu_mem=80 * GiB, host_mem=64 * GiB)
    one_node = annot.estimate_memory(model, gpus=1, **common)
    assert one_node.unavailable == () and one_node.recommendation == "ddp"
    two_nodes = annot.estimate_memory(model, gpus=4, nodes=2, **common)
    keys = {r.key for r in two_nodes.rows}
    assert "tp-fsdp2" not in keys and {"fsdp2-hsdp", "zero3-hpz", "fsdp2"} <= keys
    ((label, why),) = two_nodes.unavailable
    assert label == "TP 4 x FSDP2 2" and "replicated_with_grad_allreduce" in why
    assert re.search(rf"^{re.escape(label)} +unavailable: {re.escape(why)}$", two_nodes.table(), re.M)
    assert two_nodes.to_dict()["unavailable"] == ((label, why),)


@pytest.mark.slow
def test_a_tp_plan_annot_applies_keeps_the_tp_row():
    model = _gpt_with_tp_plan({"transformer.h.*.attn.c_attn": "colwise",
                               "transformer.h.*.attn.c_proj": "rowwise"})
    report = annot.estimate_memory(model, gpus=4, nodes=2, batch=1, seq=32,
                                   gpu_mem=80 * GiB, host_mem=64 * GiB)
    assert "tp-fsdp2" in {r.key for r in report.rows} and report.unavailable == ()


def test_fused_attention_on_the_cpu_counts_the_flops_of_its_two_matmuls():
    """torch's formula registry has no entry for the CPU kernel of
    scaled_dot_product_attention; annot counts it as the GPU flash kernel."""
    from annot.memory.counting import FlopCount

    b, h, t, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    counter = FlopCount()
    with counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    forward = counter.total
    assert forward == 2 * (2 * b * h * t * t * d)  # scores q @ k^T, then scores @ v
    with counter:
        out.sum().backward()
    # backward (torch's formula): the scores again, and the gradients of scores, q, k, v
    assert counter.total - forward == 5 * forward // 2
