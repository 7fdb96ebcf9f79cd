"""`SafetensorsFile.map_rows` and `layout.local`, in this process (a one-rank group for
the DTensor): the pieces of a mapped load (``mmap=True``) that need no launch."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from annot.checkpoint_io.safetensors_file import SafetensorsFile
from annot.meta.layout import local


def test_rows_of_every_tensor_come_from_one_private_map_of_the_file(tmp_path):
    """Row ranges of several tensors (odd sizes, so most start mid-page) equal the file's
    values, all lie in one map of the file, and writing one copies its pages for this
    process only: the file and the other tensors keep their bytes."""
    tensors = {"a": torch.randn(7, 5), "b": torch.arange(33, dtype=torch.float64).reshape(11, 3),
               "c": torch.randn(3), "d": torch.randint(0, 9, (5, 2), dtype=torch.int16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    before = path.read_bytes()
    handle = SafetensorsFile(path)
    mapped = {name: handle.map_rows(name, 1, tensor.shape[0]) for name, tensor in tensors.items()}
    for name, tensor in tensors.items():
        assert torch.equal(mapped[name], tensor[1:]), name
    # One region, not a map per tensor: the tensors lie as far apart as in the file.
    first_row = {name: handle.data_start + handle.entries[name].begin
                 + (handle.entries[name].end - handle.entries[name].begin) // tensor.shape[0]
                 for name, tensor in tensors.items()}
    assert {name: m.data_ptr() - first_row[name] for name, m in mapped.items()} == dict.fromkeys(
        tensors, mapped["a"].data_ptr() - first_row["a"])

    mapped["b"].fill_(-1.0)
    assert torch.equal(mapped["a"], tensors["a"][1:])
    assert path.read_bytes() == before
    assert torch.equal(SafetensorsFile(path).map_rows("b", 0, 11), tensors["b"])


def _unaligned_file(path) -> None:
    """A valid safetensors file whose fp32 tensor starts 3 bytes into the data (after 3
    int8 values), as a writer that does not pad may leave it."""
    header = json.dumps({"x": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
                         "y": {"dtype": "F32", "shape": [2, 1], "data_offsets": [3, 11]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytes([1, 2, 3]) + struct.pack("<2f", 0.5, -2.0)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_rows_that_the_dtype_cannot_align_are_left_to_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    _unaligned_file(path)
    handle = SafetensorsFile(path)
    assert handle.map_rows("y", 0, 2) is None  # a float at an odd address: read instead
    assert torch.equal(handle.read("y"), torch.tensor([[0.5], [-2.0]]))
    assert torch.equal(handle.map_rows("x", 1, 3), torch.tensor([2, 3], dtype=torch.int8))
    assert handle.map_rows("x", 1, 1) is None  # no rows: nothing to map


def test_local_is_the_dtensors_own_part(one_rank):
    """A write into `local` of a DTensor is a write into the DTensor (the fills of a
    sharded load go through it), and a plain tensor is its own part."""
    value = DTensor.from_local(torch.zeros(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    local(value).fill_(3.0)
    assert torch.equal(value.full_tensor(), torch.full((4, 2), 3.0))
    plain = torch.ones(2)
    assert local(plain) is plain
