"""`PositionedFile`: byte ranges at any offset land exactly, whether their whole blocks go
with O_DIRECT or through the page cache, next to ranges other writers fill (the partial
blocks two ranks share), and a filesystem that refuses O_DIRECT falls back without
losing a byte."""

from __future__ import annotations

import errno
import itertools
import os
import random
from pathlib import Path

import pytest
import torch

from annot.checkpoint_io import direct_write
from annot.checkpoint_io.direct_write import ALIGN, DIRECT_VARIABLE, PositionedFile


def _supports_direct(folder: Path) -> bool:
    probe = folder / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    try:
        import mmap

        block = mmap.mmap(-1, ALIGN)
        os.pwrite(fd, block, 0)
        block.close()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def _ranges(total: int, seed: int) -> list[tuple[int, int]]:
    """Cut [0, total) into adjacent ranges of awkward lengths: under a block, across
    block and chunk boundaries, some empty."""
    rng = random.Random(seed)
    cuts, at = [0], 0
    while at < total:
        at = min(total, at + rng.choice([0, 1, 7, 100, ALIGN - 3, ALIGN, 3 * ALIGN + 5, 5 * ALIGN - 1, 11 * ALIGN + 17]))
        cuts.append(at)
    return list(itertools.pairwise(cuts))


def _fill(path: Path, expected: bytes, writers: int, seed: int) -> list[PositionedFile]:
    """Write ``expected`` into ``path`` as adjacent ranges, shuffled, dealt round-robin to
    ``writers`` open files (as ranks sharing a file); returns the closed writers."""
    first = PositionedFile(path, size=len(expected))
    files = [first, *(PositionedFile(path) for _ in range(writers - 1))]
    pieces = _ranges(len(expected), seed)
    random.Random(seed + 1).shuffle(pieces)
    data = torch.frombuffer(bytearray(expected), dtype=torch.uint8)
    dtypes = [torch.uint8, torch.int16, torch.float32, torch.float64]
    for i, (begin, end) in enumerate(pieces):
        dtype = dtypes[i % len(dtypes)]
        piece = data[begin:end]
        if (end - begin) % dtype.itemsize == 0:
            piece = piece.clone().view(dtype)  # the writer takes any dtype's bytes
        files[i % writers].write_at(begin, piece)
    for f in files:
        f.close()
    return files


@pytest.mark.parametrize("writers", [1, 2])
def test_ranges_land_exactly_next_to_each_other(tmp_path, monkeypatch, writers):
    monkeypatch.setattr(direct_write, "CHUNK", 2 * ALIGN)  # many chunks: both buffers reused
    real_open, real_pwrite, real_fsync = os.open, os.pwrite, os.fsync
    direct_fds: set[int] = set()
    pages: dict[str, set[int]] = {"direct": set(), "buffered": set()}
    synced: list[int] = []

    def recording_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def recording_pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        kind = "direct" if fd in direct_fds else "buffered"
        if kind == "direct":
            assert offset % ALIGN == 0 and n % ALIGN == 0, (offset, n)
        pages[kind].update(range(offset // ALIGN, -(-(offset + n) // ALIGN)))
        return n

    def recording_fsync(fd):
        synced.append(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    expected = os.urandom(40 * ALIGN + 123)
    path = tmp_path / "f.bin"
    files = _fill(path, expected, writers, seed=writers)
    assert path.read_bytes() == expected
    assert len(synced) == writers  # one fsync per open file, at close
    assert not pages["direct"] & pages["buffered"]  # no page written both ways
    if _supports_direct(tmp_path):
        assert sum(f.direct_bytes for f in files) > len(expected) // 2
        assert all(f.direct_bytes % ALIGN == 0 for f in files)


def test_without_direct_every_byte_goes_through_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(DIRECT_VARIABLE, "0")
    expected = os.urandom(9 * ALIGN + 5)
    files = _fill(tmp_path / "f.bin", expected, 2, seed=3)
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert [f.direct_bytes for f in files] == [0, 0]


def test_a_filesystem_refusing_o_direct_at_open_or_on_write(tmp_path, monkeypatch):
    real_open, real_pwrite = os.open, os.pwrite
    expected = os.urandom(12 * ALIGN + 9)

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_open)
    (f,) = _fill(tmp_path / "a.bin", expected, 1, seed=4)
    assert not f.direct and (tmp_path / "a.bin").read_bytes() == expected
    monkeypatch.setattr(os, "open", real_open)

    refused = []

    def refusing_pwrite(fd, data, offset):
        if fd == writer.direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "opened, but these writes are refused")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    writer = PositionedFile(tmp_path / "b.bin", size=len(expected))
    if not writer.direct:
        writer.abort()
        pytest.skip(f"{tmp_path} has no O_DIRECT: the write-time fallback cannot be reached")
    writer.write_at(0, torch.frombuffer(bytearray(expected), dtype=torch.uint8))
    writer.close()
    assert refused and (tmp_path / "b.bin").read_bytes() == expected


def test_a_tensor_not_contiguous_is_written_in_its_logical_order(tmp_path):
    base = torch.arange(3 * ALIGN, dtype=torch.int32).reshape(3, ALIGN)
    f = PositionedFile(tmp_path / "t.bin", size=base.numel() * 4 + 1)
    f.write_at(1, base.t())
    f.close()
    back = torch.frombuffer(bytearray((tmp_path / "t.bin").read_bytes()[1:]), dtype=torch.int32)
    assert torch.equal(back, base.t().reshape(-1))


def test_a_failed_write_surfaces_at_close_and_closes_the_file(tmp_path, monkeypatch):
    writer = PositionedFile(tmp_path / "c.bin", size=8 * ALIGN)
    if not writer.direct:
        writer.abort()
        pytest.skip(f"{tmp_path} has no O_DIRECT: the worker thread is not used")

    def broken(fd, data, offset):
        raise OSError(errno.ENOSPC, "disk full")

    monkeypatch.setattr(os, "pwrite", broken)
    writer.write_at(0, torch.zeros(8 * ALIGN, dtype=torch.uint8))  # queued on the worker
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert writer.fd == -1 and writer.direct_fd == -1


def test_a_write_that_failed_inside_write_at_still_fails_close(tmp_path, monkeypatch):
    writer = PositionedFile(tmp_path / "d.bin", size=8 * ALIGN)
    if not writer.direct:
        writer.abort()
        pytest.skip(f"{tmp_path} has no O_DIRECT: the worker thread is not used")
    monkeypatch.setattr(direct_write, "CHUNK", ALIGN)
    real_pwrite = os.pwrite

    def first_fails(fd, data, offset):
        if offset == 0:
            raise OSError(errno.EIO, "bad block")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", first_fails)
    # Three chunks: the third waits for the first's buffer and meets its failure.
    with pytest.raises(OSError, match="bad block"):
        writer.write_at(0, torch.zeros(8 * ALIGN, dtype=torch.uint8))
    with pytest.raises(OSError, match="bad block"):
        writer.close()  # the caller went on regardless: the file must not look whole
    assert writer.fd == -1
