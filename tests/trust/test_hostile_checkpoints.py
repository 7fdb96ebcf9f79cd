"""Crafted and corrupt checkpoints (issue #20, docs/design.md pitfall 17): each one either
loads the right values or raises `annot.CheckpointError` naming the file and the key; no
wrong value is ever loaded, nothing outside the checkpoint's folder is read, and a shape
mismatch is refused before anything is allocated.

The files are written byte by byte here (`_write`), so every case is exactly the header
under test; the reference for what must be refused is what the safetensors library itself
refuses (checked alongside where it applies)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import annot
from annot.checkpoint_io import loading
from annot.meta.unit_allocation import UnitAllocator

safetensors_torch = pytest.importorskip("safetensors.torch")


class Pair(nn.Module):
    """Two float tensors: enough for overlap, order and dtype cases."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2, 3))
        self.b = nn.Parameter(torch.zeros(4))


A = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5
B = torch.arange(4, dtype=torch.float32) - 7.25


def _write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}


def _data() -> bytes:
    return A.numpy().tobytes() + B.numpy().tobytes()


def test_a_well_formed_file_loads_the_right_values(tmp_path):
    file = _write(tmp_path / "ok.safetensors", _good_header(), _data())
    model = Pair()
    annot.load(model, file)
    assert torch.equal(model.a, A) and torch.equal(model.b, B)
    assert torch.equal(safetensors_torch.load_file(file)["a"], A)  # the library agrees


def _raw_header(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


# Each case: (id, header as a dict or raw JSON text, data, what the message must say).
BAD_HEADERS = [
    ("overlapping ranges", {**_good_header(), "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
     _data()[:24], r"b: data_offsets \[8, 24\] overlaps"),
    ("gap between tensors", {**_good_header(), "b": {"dtype": "F32", "shape": [4], "data_offsets": [28, 44]}},
     _data() + b"\0" * 4, r"b: data_offsets \[28, 44\] leaves a gap"),
    ("range shorter than dtype x shape", {**_good_header(), "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 36]}},
     _data()[:36], r"b: 12 bytes of data for F32 \[4\], which needs 16"),
    ("range longer than dtype x shape", {**_good_header(), "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 44]}},
     _data() + b"\0" * 4, r"b: 20 bytes of data for F32 \[4\], which needs 16"),
    ("dtype changed, shape kept", {**_good_header(), "a": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}},
     _data(), r"a: 24 bytes of data for F16 \[2, 3\], which needs 12"),
    ("offsets as strings", {**_good_header(), "b": {"dtype": "F32", "shape": [4], "data_offsets": ["24", "40"]}},
     _data(), r"b: data_offsets \['24', '40'\] is not \[begin, end\]"),
    ("an entry that is a number", {**_good_header(), "b": 7}, _data(),
     "b: an entry needs exactly dtype, shape and data_offsets"),
    ("a negative dimension", {**_good_header(), "b": {"dtype": "F32", "shape": [-4], "data_offsets": [24, 40]}},
     _data(), r"b: shape \[-4\] is not a list of non-negative integers"),
    ("unknown dtype", {**_good_header(), "b": {"dtype": "F33", "shape": [4], "data_offsets": [24, 40]}},
     _data(), "b: unknown dtype 'F33'"),
    ("truncated data", _good_header(), _data()[:30], "b: the file ends before its data"),
    ("bytes after the last tensor", _good_header(), _data() + b"\0" * 8, "8 bytes after the last tensor"),
    ("metadata that is not strings", {**_good_header(), "__metadata__": {"format": 1}}, _data(),
     "__metadata__ is not an object of strings"),
    ("the same key twice",
     '{"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, '
     '"b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}, '
     '"b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}',
     _data(), "the header names 'b' twice"),
    ("not JSON", "{not json", _data(), "the header is not UTF-8 JSON"),
    ("a JSON list", "[1, 2]", _data(), "the header is not a JSON object"),
]


@pytest.mark.parametrize("header, data, message", [c[1:] for c in BAD_HEADERS], ids=[c[0] for c in BAD_HEADERS])
def test_a_malformed_header_is_refused_naming_file_and_key(tmp_path, header, data, message):
    file = tmp_path / "bad.safetensors"
    if isinstance(header, str):
        file.write_bytes(_raw_header(header) + data)
    else:
        _write(file, header, data)
    model = Pair()
    with pytest.raises(annot.CheckpointError, match=message) as info:
        annot.load(model, file)
    assert str(file) in str(info.value)
    assert torch.equal(model.a, torch.zeros(2, 3)) and torch.equal(model.b, torch.zeros(4))


@pytest.mark.parametrize("case", ["overlapping ranges", "range shorter than dtype x shape",
                                  "dtype changed, shape kept", "truncated data", "unknown dtype"])
def test_what_we_refuse_the_safetensors_library_refuses_too(tmp_path, case):
    header, data, _ = next(c[1:] for c in BAD_HEADERS if c[0] == case)
    file = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(Exception):  # noqa: B017, PT011 - its own error types vary by case
        safetensors_torch.load_file(file)


def test_float_bits_relabelled_as_integers_are_refused(tmp_path):
    """An F32 tensor relabelled I32 has a valid header (same size); loading it into float
    weights would cast integer bit patterns into values. annot converts only between
    floating-point types."""
    header = {**_good_header(), "a": {"dtype": "I32", "shape": [2, 3], "data_offsets": [0, 24]}}
    file = _write(tmp_path / "relabelled.safetensors", header, _data())
    model = Pair()
    with pytest.raises(annot.CheckpointError, match=r"relabelled.safetensors: a: stored as torch.int32"):
        annot.load(model, file)
    assert torch.equal(model.a, torch.zeros(2, 3))


def test_float_to_float_conversion_still_loads(tmp_path):
    file = tmp_path / "half.safetensors"
    safetensors_torch.save_file({"a": A.half(), "b": B.bfloat16()}, file)
    model = Pair()
    annot.load(model, file)
    assert torch.equal(model.a, A.half().float()) and torch.equal(model.b, B.bfloat16().float())


def _index(folder: Path, weight_map: object) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("weight_map, message", [
    (["a", "b"], "weight_map must be an object"),
    ("model.safetensors", "weight_map must be an object"),
    ({"a": 1, "b": 2}, "weight_map must be an object"),
], ids=["a list", "a string", "numbers"])
def test_a_malformed_index_is_refused(tmp_path, weight_map, message):
    _index(tmp_path, weight_map)
    with pytest.raises(annot.CheckpointError, match=message):
        annot.load(Pair(), tmp_path)


def _outside_cases(tmp_path: Path) -> dict[str, str]:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    _write(outside / "x.safetensors", _good_header(), _data())
    return {"relative ..": "../elsewhere/x.safetensors",
            "absolute": str(outside / "x.safetensors"),
            "a link leading out": "link.safetensors"}


@pytest.mark.parametrize("case", ["relative ..", "absolute", "a link leading out"])
def test_an_index_never_leads_outside_its_folder(tmp_path, case):
    folder = tmp_path / "ck"
    folder.mkdir()
    target = _outside_cases(tmp_path)[case]
    os.symlink(tmp_path / "elsewhere" / "x.safetensors", folder / "link.safetensors")
    _index(folder, {"a": target, "b": target})
    model = Pair()
    with pytest.raises(annot.CheckpointError, match="is outside"):
        annot.load(model, folder)
    assert torch.equal(model.a, torch.zeros(2, 3))


def test_a_link_inside_the_folder_is_followed(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    _write(folder / "real.safetensors", _good_header(), _data())
    os.symlink("real.safetensors", folder / "alias.safetensors")
    _index(folder, {"a": "alias.safetensors", "b": "alias.safetensors"})
    model = Pair()
    annot.load(model, folder)
    assert torch.equal(model.a, A)


@pytest.mark.parametrize("engine", [None, "fsdp2", "fsdp1"])
def test_a_shape_mismatch_is_refused_before_anything_is_allocated(tmp_path, monkeypatch, engine, request):
    """A config claiming a 2**31-row vocabulary beside a small checkpoint: the headers say
    the shapes differ, so nothing is allocated (counted: calls to the allocation steps of
    loading and of unit-by-unit allocation), with no engine and under a sharding engine."""
    if engine is not None:
        request.getfixturevalue("one_rank")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "vocab_size": 2**31}))
    allocations: list[object] = []
    for owner, name in ((loading, "_allocate"), (UnitAllocator, "__call__")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **k: allocations.append(a) or real(*a, **k))
    with pytest.raises(annot.CheckpointError, match=r"model.safetensors: \S+: checkpoint shape \(64, 16\) "
                                                    r"!= model shape \(2147483648, 16\)"):
        annot.from_pretrained(tmp_path, engine, strict=False)
    assert allocations == []
