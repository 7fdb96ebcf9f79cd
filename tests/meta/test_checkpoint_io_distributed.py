"""Sharded load and save on 2 CPU ranks (FSDP2, gloo); loading while FSDP1 and ZeRO-3
allocate unit by unit (one launch for both)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import annot
from examples.gpt.model import GPT
from tests.distributed import torchrun

WORKER = Path(__file__).with_name("fsdp2_checkpoint_worker.py")
SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)


@pytest.mark.distributed
def test_each_rank_reads_its_half_and_saving_from_shards_gives_the_same_files(tmp_path):
    torch.manual_seed(11)
    source = GPT(**SHAPE)
    annot.save(source, tmp_path / "source", max_shard_bytes=100_000)
    annot.save(source, tmp_path / "single", max_shard_bytes=100_000)  # the one-process save
    torchrun(WORKER, str(tmp_path / "results.pt"), str(tmp_path / "source"), str(tmp_path))
    results = torch.load(tmp_path / "results.pt")
    total = sum(p.numel() * 4 for p in source.parameters())
    for r in results:
        # Half the rows of every tensor, give or take the rounding of odd row counts.
        assert 0.45 * total <= r["bytes_read"] <= 0.55 * total, (r, total)
        assert r["dcp_same"] and r["tied"]
    assert sum(r["bytes_read"] for r in results) == total
    # Each rank wrote its own rows into the save's files (no gather to one writer): about
    # half of the tensors' bytes each, beside the headers, index and config.
    for r in results:
        assert 0.45 * total <= r["bytes_written"] <= 0.55 * total + 50_000, (r, total)
    single = sorted((tmp_path / "single").iterdir())
    saved = sorted((tmp_path / "saved").iterdir())
    assert [p.name for p in single] == [p.name for p in saved]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(single, saved, strict=True))


FLAT_WORKER = Path(__file__).with_name("flat_checkpoint_worker.py")
FLAT_ENGINES = ("fsdp1", "zero3")


@pytest.fixture(scope="module")
def flat_loads(tmp_path_factory) -> tuple[GPT, dict[str, dict]]:
    """The source model, and what each engine loaded from its files: one launch runs
    every engine (ZeRO-3 only where DeepSpeed is installed)."""
    tmp_path = tmp_path_factory.mktemp("flat_load")
    torch.manual_seed(11)
    source = GPT(**SHAPE)
    annot.save(source, tmp_path / "source", max_shard_bytes=100_000)
    engines = [e for e in FLAT_ENGINES
               if e != "zero3" or importlib.util.find_spec("deepspeed") is not None]
    torchrun(FLAT_WORKER, str(tmp_path / "out.pt"), str(tmp_path / "source"), *engines,
             timeout=300 * len(engines))
    return source, torch.load(tmp_path / "out.pt") | {"dir": tmp_path}


@pytest.mark.distributed
@pytest.mark.parametrize("engine", FLAT_ENGINES)
def test_fsdp1_and_zero3_load_each_rank_reads_about_its_half(engine, flat_loads):
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    source, loads = flat_loads
    got = loads[engine]
    for name, param in source.named_parameters():
        assert torch.equal(got["params"][name], param), name
    for name, buffer in source.named_buffers():  # the causal masks, recomputed
        assert torch.equal(got["buffers"][name], buffer), name
    total = sum(p.numel() * 4 for p in source.parameters())
    # Flat shards split rows: a rank reads the rows its range covers, partial rows whole.
    for read in got["bytes_read"]:
        assert 0.45 * total <= read <= 0.6 * total, (got["bytes_read"], total)


@pytest.mark.distributed
@pytest.mark.parametrize("engine", FLAT_ENGINES)
def test_fsdp1_and_zero3_save_the_files_one_process_saves(engine, flat_loads):
    """Byte for byte: FSDP1 gathers each unit once for all its parameters, ZeRO-3 one
    parameter at a time, and the writer thread writes behind the gathers."""
    if engine == "zero3":
        pytest.importorskip("deepspeed")
    source, loads = flat_loads
    annot.save(source, loads["dir"] / "single", max_shard_bytes=100_000, overwrite=True)
    single = sorted((loads["dir"] / "single").iterdir())
    saved = sorted((loads["dir"] / f"saved-{engine}").iterdir())
    assert len(single) > 2 and [p.name for p in single] == [p.name for p in saved]
    assert [p.name for p, q in zip(single, saved, strict=True) if p.read_bytes() != q.read_bytes()] == []
