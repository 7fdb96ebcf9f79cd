"""Context-parallel rows of `estimate_memory` (`annot.memory.context_parallel`): traced at
a rank's part of the sequence, the other ranks' keys and values added to memory, the cp
group's collectives to communication; and the published case, Llama-3-8B at 131072
tokens on 8 GPUs (sweep lane: it traces 131072-token steps)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from annot.memory import MemoryInputError, estimate_memory
from annot.memory.communication import Layout, Network, step_communication
from annot.memory.context_parallel import (
    AttentionShape,
    attention_shape,
    cp_collectives,
    cp_gathered_bytes,
)
from examples.gpt.model import GPT

GiB = 2**30
SEQ = 64


def _rows(seq: int, keys: tuple[str, ...], cp: tuple[int, ...]) -> list:
    """The rows ``keys`` of `estimate_memory`'s table on 4 GPUs, without the others (each
    row traces)."""
    from annot.memory.report import _rows
    from annot.policies import make_plan

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)
    rows, _, _, _ = _rows(
        model, make_plan(model), network=Network(gpus_per_node=4, nodes=1), batch=2, seq=seq,
        precision="fp32", optimizer="adamw", gpu_mem=GiB, host_mem=GiB, margin=0.1, reserve=0,
        inputs=None, styles={}, keys=keys, cp=cp)
    return rows


class Rows:
    """The cp rows of `estimate_memory`'s table."""

    def __init__(self) -> None:
        self.rows = _rows(SEQ, ("fsdp2-cp2", "fsdp2-cp4"), (2, 4))

    def row(self, key: str):  # noqa: ANN201 (a StrategyRow)
        return next(r for r in self.rows if r.key == key)


@pytest.fixture(scope="module")
def report() -> Rows:
    return Rows()


def test_cp_rows_are_weighed_with_their_mesh(report):
    assert [r.key for r in report.rows] == ["fsdp2-cp2", "fsdp2-cp4"]
    assert "mesh_dim_names=('shard', 'cp')" in report.row("fsdp2-cp2").call


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_divides_the_traced_activations(report, cp):
    # every rank traces seq / cp tokens: its activations are those of FSDP2 on as many
    # ranks at a cp-th of the sequence, to the byte, and shrink with cp
    plain = _rows(SEQ // cp, ("fsdp2",), ())[0].detail.parts["activations"]
    assert report.row(f"fsdp2-cp{cp}").detail.parts["activations"] == plain
    whole = _rows(SEQ, ("fsdp2",), ())[0].detail.parts["activations"]
    assert plain < whole * (0.6 if cp == 2 else 0.35)


def test_cp_rows_hold_the_other_ranks_keys_and_values(report):
    # 2 layers x (keys + values) x batch 2 x 64 tokens x 32 wide x 4 bytes x (cp-1)/cp
    whole = 2 * 2 * 2 * SEQ * 32 * 4
    assert report.row("fsdp2-cp2").detail.parts["cp: other ranks' keys and values"] == whole // 2
    assert report.row("fsdp2-cp4").detail.parts["cp: other ranks' keys and values"] == whole * 3 // 4


def test_cp_collectives_are_counted_on_the_cp_group(report):
    t = report.row("fsdp2-cp2").time
    assert t is not None
    cp = [c for c in t.comm.collectives if c.dim == "cp"]
    assert {(c.op, c.what) for c in cp} == {("all-gather", "keys and values, forward"),
                                           ("all-reduce", "key and value gradients")}
    assert all(c.ranks == 2 and c.size == 2 * 2 * 2 * SEQ * 32 * 4 for c in cp)


def test_cp_traffic_in_bytes_per_rank():
    shape = AttentionShape(layers=3, query_width=16, kv_width=8)
    found = cp_collectives(shape, batch=1, seq=32, cp=4, act_bytes=2, checkpoint=True)
    size = 3 * 2 * 32 * 8 * 2  # layers x (K, V) x tokens x width x bytes
    comm = step_communication(found, Layout(shard=1, cp=4), Network(gpus_per_node=4, nodes=1))
    # two all-gathers (forward, recomputation) send 3/4 each, the all-reduce 2 x 3/4
    assert comm.intra == round(size * 3 / 4 * 2 + size * 2 * 3 / 4)
    assert comm.inter == 0


def test_attention_shape_reads_grouped_query_heads():
    # the names of a transformers config (LlamaConfig's), head_dim left to be derived
    model = torch.nn.Module()
    model.config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=3)
    assert attention_shape(model) == AttentionShape(layers=3, query_width=64, kv_width=32,
                                                    heads=4, kv_heads=2)


def test_a_cp_size_that_does_not_divide_a_node_is_refused():
    with torch.device("meta"):
        model = GPT(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)
    with pytest.raises(MemoryInputError, match="cp=3.*4 GPUs per node"):
        estimate_memory(model, gpus=4, seq=SEQ, precision="fp32", gpu_mem=GiB, host_mem=GiB, cp=(3,))


def _llama3_8b() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.sweep
def test_llama3_8b_at_131072_tokens_on_8_gpus_fits_only_with_cp8():
    model = _llama3_8b()
    report = estimate_memory(model, gpus=8, seq=131072, batch=1, gpu_mem=80 * GiB,
                             host_mem=1024 * GiB, cp=(8,))
    others = [r for r in report.rows if r.key != "fsdp2-cp8"]
    # without cp nothing fits, with or without checkpointing, offload included
    assert not any(r.fits or r.fits_checkpointed for r in others)
    assert report.recommendation == "fsdp2-cp8" and report.checkpoint is True
    assert "FSDP2 + CP 8" in report.table()


def test_ulysses_traffic_is_an_all_to_all_of_q_k_v_and_output():
    # 4 heads of width 4 (16), 2 key/value heads (8), cp 2: the key/value heads divide
    shape = AttentionShape(layers=3, query_width=16, kv_width=8, heads=4, kv_heads=2)
    found = cp_collectives(shape, batch=1, seq=32, cp=2, act_bytes=2, checkpoint=True,
                           attention="ulysses")
    # layers x local tokens x (q + out + k + v widths) x bytes
    size = 3 * 16 * (16 + 16 + 8 + 8) * 2
    assert [(c.op, c.dim, c.size) for c in found] == [("all-to-all", "cp", size)] * 3
    comm = step_communication(found, Layout(shard=1, cp=2), Network(gpus_per_node=2, nodes=1))
    assert comm.intra == round(3 * size / 2)  # each rank keeps half of its part


def test_ulysses_repeats_kv_heads_that_do_not_divide_in_traffic_and_memory():
    shape = AttentionShape(layers=3, query_width=16, kv_width=4, heads=4, kv_heads=1)
    found = cp_collectives(shape, batch=1, seq=32, cp=2, act_bytes=2, checkpoint=False,
                           attention="ulysses")
    assert found[0].size == 3 * 16 * (4 * 16) * 2  # k and v repeated to the query width
    # SDPA keeps the repeated copies: (16 - 4) wide, k and v, 16 local tokens, 3 layers
    assert cp_gathered_bytes(shape, batch=1, seq=32, cp=2, act_bytes=2, checkpoint=False,
                             attention="ulysses") == 3 * 2 * 16 * 12 * 2
    divides = AttentionShape(layers=3, query_width=16, kv_width=8, heads=4, kv_heads=2)
    assert cp_gathered_bytes(divides, batch=1, seq=32, cp=2, act_bytes=2, checkpoint=False,
                             attention="ulysses") == 0


def test_a_ulysses_row_holds_no_gathered_keys_and_passes_its_option():
    from annot.memory.report import _rows
    from annot.policies import make_plan

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)
    rows, _, _, _ = _rows(
        model, make_plan(model), network=Network(gpus_per_node=2, nodes=1), batch=2, seq=SEQ,
        precision="fp32", optimizer="adamw", gpu_mem=GiB, host_mem=GiB, margin=0.1, reserve=0,
        inputs=None, styles={}, keys=("fsdp2-cp2",), cp=(2,), cp_attention="ulysses")
    (row,) = rows
    assert row.label == "FSDP2 + CP 2 Ulysses" and "cp_attention='ulysses'" in row.call
    assert row.detail.parts["cp: repeated key/value heads"] == 0
    assert row.time is not None
    assert {c.op for c in row.time.comm.collectives if c.dim == "cp"} == {"all-to-all"}


def test_the_budget_chooser_weighs_cp_layouts_at_a_rank_s_part_of_the_sequence():
    from annot.memory.budget import budget_solver

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)
    solver = budget_solver(model, gpus=2, batch=2, seq=SEQ, precision="fp32", device="cpu",
                           strategies=("fsdp2",), cp=(2,), reserve=0)
    assert [s.key for s in solver.strategies] == ["fsdp2", "fsdp2-cp2"]
    fsdp2, cp2 = solver.strategies
    assert solver.seq_of(cp2) == SEQ // 2 and solver.setting(cp2).trace.seq == SEQ // 2
    # each rank keeps half the tokens' activations, plus half the keys and values
    plain = solver.setting(fsdp2).trace.peak
    assert solver.setting(cp2).trace.peak < plain
    answer = solver.fit(GiB)
    assert {f.key for f in answer.strategies} == {"fsdp2", "fsdp2-cp2"}
    assert "cp: other ranks' keys and values" in answer.strategies[1].parts


@pytest.mark.sweep
def test_llama3_8b_at_131072_tokens_on_8_gpus_has_a_budget_answer_only_with_cp():
    from annot.memory.budget import BudgetError, fit_budget

    model = _llama3_8b()
    with pytest.raises(BudgetError, match="nothing fits 80.00 GiB"):
        fit_budget(model, 80 * GiB, gpus=8, batch=1, seq=131072)
    answer = fit_budget(model, 80 * GiB, gpus=8, batch=1, seq=131072, cp=(2, 4, 8))
    assert answer.strategy.startswith("fsdp2-cp") and answer.peak_bytes <= 80 * GiB
