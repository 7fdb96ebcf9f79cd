"""The save's write path: bytes exactly as safetensors reads them, partial writes, at most
`IN_FLIGHT` whole tensors alive while a writer thread overlaps gathering and writing, and
a failure on either thread leaving nothing behind."""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest
import torch

from annot.checkpoint_io import safetensors_file, saving
from annot.checkpoint_io.entries import Entry
from annot.checkpoint_io.formats import MODEL_FILES

safetensors_torch = pytest.importorskip("safetensors.torch")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 7, generator=g)
    return {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.randint(-2**40, 2**40, (9,), generator=g),
        "i32": torch.randint(-2**30, 2**30, (2, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**14, 2**14, (4,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (5,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # not contiguous: written in its logical order
    }


def test_writer_bytes_read_back_bitwise_by_safetensors(tmp_path, monkeypatch):
    real_pwrite = os.pwrite
    calls = []

    def short_pwrite(fd, data, offset):  # the kernel may take less than asked: loop on
        calls.append(len(data))
        return real_pwrite(fd, bytes(memoryview(data)[:13]), offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    writer = safetensors_file.SafetensorsWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    assert max(calls) > 13  # partial writes happened and were continued
    back = safetensors_torch.load_file(path)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_refuses_wrong_order_size_and_an_unfinished_file(tmp_path):
    writer = safetensors_file.SafetensorsWriter(tmp_path / "t.safetensors", [("a", (2,), torch.float32),
                                                                             ("b", (3,), torch.float32)])
    with pytest.raises(ValueError, match="expected a, got b"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="8 bytes, header says 8|12 bytes, header says 8"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="only 1 of 2 tensors"):
        writer.close()
    assert writer.fd == -1  # closed all the same


class _Counted:
    """Entries whose fetch makes a fresh tensor and counts how many are alive."""

    def __init__(self, n: int) -> None:
        self.alive = self.most = 0
        self.lock = threading.Lock()
        self.values = {f"t{i}": torch.full((64, 64), float(i)) for i in range(n)}

    def _gone(self) -> None:
        with self.lock:
            self.alive -= 1

    def fetch(self, name: str) -> torch.Tensor:
        value = self.values[name].clone()
        weakref.finalize(value, self._gone)
        with self.lock:
            self.alive += 1
            self.most = max(self.most, self.alive)
        return value

    def entries(self) -> list[Entry]:
        return [Entry(name, (64, 64), torch.float32, lambda name=name: self.fetch(name))
                for name in self.values]


def _save(tmp_path, entries: list[Entry]):
    return saving._write(tmp_path / "ck", entries, lambda e: e.dtype, max_shard_bytes=None,
                         files=MODEL_FILES, extra=lambda staged: None)


def test_at_most_in_flight_whole_tensors_and_gathers_overlap_writes(tmp_path, monkeypatch):
    real_write = safetensors_file.SafetensorsWriter.write

    def slow_write(self, name, tensor):  # a slow disk: each write outlasts the next gather
        time.sleep(0.03)
        real_write(self, name, tensor)

    monkeypatch.setattr(safetensors_file.SafetensorsWriter, "write", slow_write)
    counted = _Counted(8)
    (path,) = _save(tmp_path, counted.entries())
    assert counted.most == saving.IN_FLIGHT == 2  # never more; and a gather ran beside a write
    assert counted.alive == 0
    back = safetensors_torch.load_file(path)
    assert all(torch.equal(back[k], v) for k, v in counted.values.items())


@pytest.mark.parametrize("where", ["fetch", "write"])
def test_a_failure_on_either_thread_leaves_nothing(tmp_path, monkeypatch, where):
    counted = _Counted(6)
    entries = counted.entries()
    if where == "fetch":
        def broken_fetch():
            raise RuntimeError("gather failed")

        entries[4] = Entry("t4", (64, 64), torch.float32, broken_fetch)
    else:
        real_write = safetensors_file.SafetensorsWriter.write

        def broken_write(self, name, tensor):
            if name == "t3":
                raise OSError("disk full")
            real_write(self, name, tensor)

        monkeypatch.setattr(safetensors_file.SafetensorsWriter, "write", broken_write)
    with pytest.raises((RuntimeError, OSError), match="gather failed|disk full"):
        _save(tmp_path, entries)
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("annot-save")]
