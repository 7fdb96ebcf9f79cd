"""The two-node ZeRO-3 table of docs/guides/multi-node.md is what the planner
prints: every figure recomputed for the documents' minGPT on 1 and 2 nodes of 8 GPUs with
a 1 GB/s link between them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import annot
from annot.memory.communication import Network
from annot.memory.report import _rows, _seconds, _tensor_parallel_styles
from annot.policies.plan import format_bytes
from examples.gpt.model import GPT

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "multi-node.md"
MINGPT = dict(n_layer=15, n_head=16, n_embd=3072, vocab_size=65, block_size=128)


def _table() -> list[list[str]]:
    text = GUIDE.read_text().split("**The two-node ZeRO-3 report.**", 1)[1]
    rows = re.findall(r"^\| (.+) \|$", text.split("How it is derived", 1)[0], flags=re.M)
    return [[c.strip() for c in row.split("|")] for row in rows[1:]]


@pytest.mark.slow
def test_the_guides_two_node_table_is_what_the_planner_prints():
    with torch.device("meta"):
        model = GPT(**MINGPT)
    # estimate_memory's rows, only those the table shows (the other rows' traces are slow).
    plan = annot.plan(model)
    networks = {nodes: Network(gpus_per_node=8, nodes=nodes, inter_node_bw=1e9) for nodes in (1, 2)}
    reports = {nodes: {r.label: r for r in _rows(
        model, plan, network=network, batch=1,
        seq=128, precision="fp16-mixed", optimizer="adamw", gpu_mem=40 * 2**30, host_mem=2**40,
        margin=0.1, reserve=2**30, inputs=None,
        styles=_tensor_parallel_styles(model, None, network)[0],
        keys=("zero3", "fsdp2", "fsdp2-hsdp", "zero3-hpz", "tp-fsdp2"))[0]}
        for nodes, network in networks.items()}
    table = _table()
    assert len(table) == 7
    for label, machines, gpu, intra, inter, step in table:
        row = reports[int(machines.split(" x ")[0])][label]
        t = row.time
        assert [format_bytes(row.gpu), format_bytes(t.comm.intra), format_bytes(t.comm.inter),
                _seconds(t.overlapped)] == [gpu, intra, inter, step], label
    one, two = reports[1]["ZeRO-3"].time, reports[2]["ZeRO-3"].time
    assert round(two.overlapped / one.overlapped) == 161  # the guide's "161 times"
