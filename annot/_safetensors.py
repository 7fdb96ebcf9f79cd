"""A streaming safetensors writer and a sliced reader.

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

__all__ = ["DTYPE_NAMES", "SafetensorsWriter", "read_rows"]

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


def read_rows(handle: object, name: str, start: int, stop: int, full_dim0: int) -> torch.Tensor:
    """Rows ``start:stop`` of tensor ``name`` from an open ``safe_open`` handle; only those
    bytes are read from the (memory-mapped) file."""
    if start == 0 and stop == full_dim0:
        return handle.get_tensor(name)  # type: ignore[attr-defined]
    return handle.get_slice(name)[start:stop]  # type: ignore[attr-defined]
