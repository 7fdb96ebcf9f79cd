"""`ReadQueue`: direct reads cut into pieces on several threads, staged reads through two
alternating buffers (the GPU pipeline's loop, run on the CPU with plain buffers)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import annot
from annot.checkpoint_io.read_queue import ReadQueue, read_threads
from annot.checkpoint_io.safetensors_file import SafetensorsFile


@pytest.fixture
def stored(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(37, 29), "b": torch.randn(1000).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "t.safetensors")
    return SafetensorsFile(tmp_path / "t.safetensors"), tensors


def test_direct_reads_in_small_pieces_on_threads_are_the_file_bytes(stored):
    handle, tensors = stored
    out = torch.empty(30, 29)
    queue = ReadQueue(threads=3, chunk=64)  # 3480 bytes: 55 pieces over 3 threads
    queue.direct(handle.path, "a", handle.offset_of("a", 7 * 29, out.numel()), out)
    queue.run()
    assert torch.equal(out, tensors["a"][7:])


def test_staged_reads_convert_through_alternating_buffers(stored):
    handle, tensors = stored
    out = torch.empty(990, dtype=torch.float32)
    queue = ReadQueue(threads=1, chunk=16)  # 8 bf16 values a piece: 124 pieces, buffers reused
    queue.staged(handle.path, "b", handle.offset_of("b", 10, out.numel()), out, torch.bfloat16)
    queue.run()
    assert torch.equal(out, tensors["b"][10:].float())  # bf16 -> fp32 is exact


def test_a_read_past_a_tensor_is_refused(stored):
    handle, _ = stored
    with pytest.raises(ValueError, match="past its end"):
        handle.offset_of("a", 37 * 29 - 1, 2)


def test_read_threads_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ANNOT_READ_THREADS", "2")
    assert read_threads() == 2
    monkeypatch.setenv("ANNOT_READ_THREADS", "zero")
    with pytest.raises(ValueError, match="ANNOT_READ_THREADS"):
        read_threads()


def test_a_load_converting_dtypes_is_the_cast_of_the_file(tmp_path, monkeypatch):
    torch.manual_seed(1)
    source = torch.nn.Linear(40, 30).to(torch.bfloat16)
    annot.save(source, tmp_path / "ck")
    monkeypatch.setattr("annot.checkpoint_io.read_queue.CHUNK", 64)
    target = torch.nn.Linear(40, 30)
    annot.load(target, tmp_path / "ck")
    assert all(torch.equal(a.float(), b) for a, b in zip(source.parameters(), target.parameters(), strict=True))
