"""A streaming safetensors writer and a row-range reader.

The format (documented by the safetensors project) is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
bytes. Every shape is known before any value is, so the header is written first and the
tensors are streamed one at a time: the writer never holds more than one tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

__all__ = ["DTYPE_NAMES", "SafetensorsFile", "SafetensorsWriter"]

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class SafetensorsWriter:
    """Write ``entries`` (name, shape, dtype), in that order, to ``path``: call
    `write(name, tensor)` once per entry, in order, then `close()`."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        self.order: list[str] = []
        self.sizes: dict[str, int] = {}
        offset = 0
        for name, shape, dtype in entries:
            if dtype not in DTYPE_NAMES:
                raise TypeError(f"safetensors cannot store {name} of dtype {dtype}")
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.order.append(name)
            self.sizes[name] = size
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(struct.pack("<Q", len(raw)))
        self.file.write(raw)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.next]
        if name != expected:
            raise ValueError(f"tensors must come in header order: expected {expected}, got {name}")
        data = tensor.detach().to("cpu").contiguous()
        buffer = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        if len(buffer) != self.sizes[name]:
            raise ValueError(f"{name}: {len(buffer)} bytes, header says {self.sizes[name]}")
        self.file.write(buffer)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            self.file.close()
            raise ValueError(f"only {self.next} of {len(self.order)} tensors were written")
        self.file.close()


class SafetensorsFile:
    """Read tensors, or dim-0 row ranges of them, with plain positioned reads.

    No memory map: mapped pages would count in the process's resident memory and stay
    there while the file is open; here only the rows asked for are read, straight into
    the tensor returned.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file too short for a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > 100 * 2**20:
                raise ValueError(f"header of {length} bytes is not plausible")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.entries: dict[str, dict] = header
        self._dtypes = {v: k for k, v in DTYPE_NAMES.items()}
        for name, entry in header.items():
            if entry.get("dtype") not in self._dtypes:
                raise ValueError(f"{name}: unsupported dtype {entry.get('dtype')!r}")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` along dim 0 (all of it by default)."""
        entry = self.entries[name]
        shape = list(entry["shape"])
        dtype = self._dtypes[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if not shape:  # a scalar
            start, stop = 0, 1
            row_bytes = end - begin
        else:
            start = 0 if start is None else start
            stop = shape[0] if stop is None else stop
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            shape[0] = stop - start
        out = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin + start * row_bytes)
            if out.numel() and f.readinto(out.numpy().data) != out.numel():  # .data: a memoryview
                raise ValueError(f"{name}: file ends before its data")
        return out.view(dtype).reshape(shape)
