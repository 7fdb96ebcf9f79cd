"""A streaming safetensors writer and a row-range reader.

The format (documented by the safetensors project) is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
bytes. Every shape is known before any value is, so the header is written first and the
tensors are streamed one at a time: the writer never holds more than one tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from annot.checkpoint_io.direct_write import PositionedFile, bytes_of
from annot.errors import CheckpointError

__all__ = ["DTYPES", "DTYPE_NAMES", "RangeWriter", "SafetensorsFile", "SafetensorsWriter", "TensorEntry",
           "parse_header"]

MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
# Read: every dtype name the safetensors format defines that torch has.
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()} | {
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsWriter:
    """Write ``entries`` (name, shape, dtype), in that order, to ``path``: call
    `write(name, tensor)` once per entry, in order, then `close()` (which fsyncs), or
    `abort()` to give up. The file gets its full length at once, then each tensor goes
    from its own memory to its byte range (`PositionedFile`: past the page cache where
    the filesystem allows, no copy into a byte string)."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = path
        raw, self.sizes, self.offsets = _header(entries, metadata)
        self.order = list(self.sizes)
        self.file = PositionedFile(path, size=len(raw) + sum(self.sizes.values()))
        self.next = 0
        try:
            self.file.write_at(0, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except BaseException:
            self.abort()
            raise

    @property
    def fd(self) -> int:
        """The file's descriptor; -1 once closed."""
        return self.file.fd

    @staticmethod
    def data_offsets(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                     metadata: dict[str, str] | None = None) -> dict[str, int]:
        """Where each entry's bytes start in the file the same arguments write."""
        return _header(entries, metadata)[2]

    @staticmethod
    def create_empty(path: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                     metadata: dict[str, str] | None = None) -> None:
        """Write the header of ``entries`` to ``path`` and give the file its full length
        (zeros, not stored where the filesystem allows), fsynced: ranks then fill their
        ranges with `RangeWriter`, each fsyncing what it wrote."""
        # A writer's constructor does exactly this; its file is closed (fsynced: the header
        # is no rank's range, durable here, not by chance) before any tensor is written.
        SafetensorsWriter(path, entries, metadata).file.close()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self.next]
        if name != expected:
            raise ValueError(f"tensors must come in header order: expected {expected}, got {name}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != self.sizes[name]:
            raise ValueError(f"{name}: {nbytes} bytes, header says {self.sizes[name]}")
        self.file.write_at(self.offsets[name], tensor)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            self.abort()
            raise ValueError(f"only {self.next} of {len(self.order)} tensors were written")
        self.file.close()  # fsynced: on disk before any rename makes it the checkpoint

    def abort(self) -> None:
        """Close the file as it is (a failed save removes it)."""
        self.file.abort()


def _header(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
            metadata: dict[str, str] | None) -> tuple[bytes, dict[str, int], dict[str, int]]:
    """The 8-byte length and JSON header of a file of ``entries`` (in order), each
    entry's byte size, and where its bytes start in the file."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    sizes: dict[str, int] = {}
    begins: dict[str, int] = {}
    offset = 0
    for name, shape, dtype in entries:
        if dtype not in DTYPE_NAMES:
            raise TypeError(f"safetensors cannot store {name} of dtype {dtype}")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        sizes[name] = size
        begins[name] = offset
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as safetensors does
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, sizes, {n: start + b for n, b in begins.items()}


class RangeWriter(PositionedFile):
    """Positioned writes into a file `SafetensorsWriter.create_empty` made (one rank's
    ranges of a save every rank writes into); `close()` fsyncs what was written."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: its dtype, shape and byte range in the data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:  # json.loads would keep the last one silently
            raise CheckpointError(f"the header names {key!r} twice")
        seen[key] = value
    return seen


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(raw: bytes, data_size: int) -> dict[str, TensorEntry]:
    """Check a safetensors header as strictly as the safetensors library does and return
    its tensors. ``data_size`` is the number of bytes after the header.

    Refused (`CheckpointError` naming the key): JSON that is not an object of objects,
    a key given twice, an unknown dtype, a shape or offsets that are not lists of
    non-negative integers, a byte range whose length is not dtype x shape, ranges that
    overlap, leave gaps or do not end exactly at the end of the data (a truncated or
    padded file). Callers prefix the file name."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"the header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError("the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("__metadata__ is not an object of strings")
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{name}: an entry needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CheckpointError(f"{name}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(o) for o in offsets) or offsets[1] < offsets[0]):
            raise CheckpointError(f"{name}: data_offsets {offsets!r} is not [begin, end]")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{name}: {offsets[1] - offsets[0]} bytes of data for {dtype} "
                                  f"{shape}, which needs {nbytes}")
        entries[name] = TensorEntry(DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
    end = 0  # the ranges must tile the data exactly, as the safetensors library requires
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            what = "overlaps the tensor before it" if entry.begin < end else "leaves a gap before it"
            raise CheckpointError(f"{name}: data_offsets {[entry.begin, entry.end]} {what}")
        if entry.end > data_size:
            raise CheckpointError(f"{name}: the file ends before its data (truncated: "
                                  f"{data_size} bytes of data, this tensor ends at {entry.end})")
        end = entry.end
    if end != data_size:
        raise CheckpointError(f"{data_size - end} bytes after the last tensor's data")
    return entries


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable view of its own memory."""
    return bytes_of(tensor).numpy().data.cast("B")


class SafetensorsFile:
    """Read tensors, or dim-0 row ranges of them, with plain positioned reads, from a file
    whose header passed `parse_header` (every failure is a `CheckpointError` naming the
    file and, where there is one, the key).

    Reads copy the rows asked for straight into the tensor returned. `map_rows` instead
    maps them (``annot.load(..., mmap=True)``): nothing is copied until a page is
    written, and the tensor depends on the file staying as it is (docs/design.md,
    pitfall 28).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise CheckpointError(f"{path}: too short for a safetensors header")
                (length,) = struct.unpack("<Q", raw)
                size = os.fstat(f.fileno()).st_size
                if length > MAX_HEADER or 8 + length > size:
                    raise CheckpointError(f"{path}: a header of {length} bytes is not plausible "
                                          f"in a file of {size} bytes")
                header = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        try:
            self.entries = parse_header(header, size - 8 - length)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        self.data_start = 8 + length
        self._map: mmap.mmap | None = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def offset_of(self, name: str, first: int = 0, count: int = 0) -> int:
        """Where in the file element ``first`` (flat index) of ``name`` is; ``ValueError``
        when elements ``first..first + count`` are not all inside the tensor."""
        entry = self.entries[name]
        itemsize = entry.dtype.itemsize
        if first < 0 or count < 0 or entry.begin + (first + count) * itemsize > entry.end:
            raise ValueError(f"{self.path}: {name}: elements {first}..{first + count} are past its end")
        return self.data_start + entry.begin + first * itemsize

    def read_into(self, name: str, out: torch.Tensor, first: int = 0) -> int:
        """Fill ``out`` (a contiguous CPU tensor of the file's dtype) with the elements of
        ``name`` from flat index ``first`` on, straight from the file: no intermediate
        buffer, no second copy. Returns the bytes read."""
        entry = self.entries[name]
        if out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{name}: read_into needs a contiguous CPU {entry.dtype} tensor")
        itemsize = out.element_size()
        begin = entry.begin + first * itemsize
        if begin + out.numel() * itemsize > entry.end:
            raise ValueError(f"{name}: elements {first}..{first + out.numel()} are past its end")
        if not out.numel():
            return 0
        view = _bytes_of(out)
        self._pread(name, self.data_start + begin, view)
        return len(view)

    def _pread(self, name: str, offset: int, view: memoryview) -> None:
        try:
            with open(self.path, "rb", buffering=0) as f:
                self._pread_all(f.fileno(), name, offset, view)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: {name}: cannot read ({exc.strerror or exc})") from None

    def _pread_all(self, fd: int, name: str, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:  # the file shrank after its header was checked
                raise CheckpointError(f"{self.path}: {name}: the file ends before its data")
            done += got

    def map_rows(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows ``start:stop`` along dim 0 of ``name`` (all of a scalar: ``0, 1``) as a
        private map of the file: nothing is read now, a page comes from the page cache
        when first touched, and a write copies that page for this process only (the file
        never changes). ``None`` when there is nothing to map or the rows' offset is not
        a multiple of the dtype's size (a tensor must be aligned): read those instead."""
        entry = self.entries[name]
        shape = list(entry.shape)
        rows = shape[0] if shape else 1
        row_bytes = (entry.end - entry.begin) // rows if rows else 0
        offset = self.data_start + entry.begin + start * row_bytes
        nbytes = (stop - start) * row_bytes
        itemsize = entry.dtype.itemsize
        if nbytes <= 0 or offset % itemsize:
            return None
        if shape:
            shape[0] = stop - start
        region = self._region()
        if len(region) < offset + nbytes:
            raise CheckpointError(f"{self.path}: {name}: the file ends before its data")
        # Start reading the rows in now, in the background (the page cache may not hold them):
        # the first touch then waits less.
        first_page = offset - offset % mmap.PAGESIZE
        region.madvise(mmap.MADV_WILLNEED, first_page, offset + nbytes - first_page)
        # The tensor holds the map (frombuffer keeps its buffer alive); unmapped when the
        # last tensor on it is freed.
        return torch.frombuffer(region, dtype=entry.dtype, count=nbytes // itemsize,
                                offset=offset).view(shape)

    def _region(self) -> mmap.mmap:
        """The whole file, mapped privately once for every `map_rows` of this handle: a
        map per tensor cost an open, a stat and a map call each (201 of each for a 1.1B
        Llama), and a model of tens of thousands of tensors would near the kernel's limit
        on maps per process (``vm.max_map_count``, 65,530 by default). Mapping reserves
        addresses only; a rank's memory holds the pages it touches."""
        if self._map is None:
            try:
                with open(self.path, "rb") as f:  # the map keeps the file; the descriptor can go
                    self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:  # ValueError: an empty file
                raise CheckpointError(f"{self.path}: cannot map ({getattr(exc, 'strerror', None) or exc})") from None
        return self._map

    def read_block(self, name: str, start: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """Indices ``start[d]:start[d] + shape[d]`` in every dimension, in the file's dtype,
        reading only their bytes: one positioned read per contiguous run (a row of a
        column block), all through one open file."""
        entry = self.entries[name]
        full = entry.shape
        if len(start) != len(full) or len(shape) != len(full) or any(
                b < 0 or n < 0 or b + n > f for b, n, f in zip(start, shape, full, strict=True)):
            raise ValueError(f"{name}: block at {tuple(start)} of shape {tuple(shape)} is not "
                             f"inside its shape {full}")
        itemsize = entry.dtype.itemsize
        out = torch.empty(math.prod(shape) * itemsize, dtype=torch.uint8)
        if not out.numel():
            return out.view(entry.dtype).reshape(tuple(shape))
        # The innermost narrowed dimension ends each contiguous run.
        last = max((d for d in range(len(full)) if shape[d] != full[d]), default=0)
        strides = [math.prod(full[d + 1:]) for d in range(len(full))]
        run = shape[last] * strides[last] * itemsize
        buffer = out.numpy().data.cast("B")
        try:
            with open(self.path, "rb", buffering=0) as f:
                for i, outer in enumerate(itertools.product(
                        *(range(s, s + n) for s, n in zip(start[:last], shape[:last], strict=True)))):
                    element = sum(o * strides[d] for d, o in enumerate(outer)) + start[last] * strides[last]
                    self._pread_all(f.fileno(), name, self.data_start + entry.begin + element * itemsize,
                                    buffer[i * run:(i + 1) * run])
        except OSError as exc:
            raise CheckpointError(f"{self.path}: {name}: cannot read ({exc.strerror or exc})") from None
        return out.view(entry.dtype).reshape(tuple(shape))

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` along dim 0 (all of it by default), in the file's dtype."""
        entry = self.entries[name]
        shape = list(entry.shape)
        if not shape:  # a scalar
            start, stop = 0, 1
            row_bytes = entry.end - entry.begin
        else:
            start = 0 if start is None else start
            stop = shape[0] if stop is None else stop
            row_bytes = (entry.end - entry.begin) // shape[0] if shape[0] else 0
            shape[0] = stop - start
        out = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        if out.numel():
            self._pread(name, self.data_start + entry.begin + start * row_bytes,
                        out.numpy().data.cast("B"))
        return out.view(entry.dtype).reshape(shape)
