"""Which tensors ``mmap=True`` left as memory of their own: their storage is checked
against the process's file mappings (/proc/self/maps, Linux)."""

from __future__ import annotations

from pathlib import Path

import torch

from annot.meta.layout import local


def not_mapped(model: torch.nn.Module, directory: Path) -> list[str]:
    """Parameters whose (local) storage does not lie in a mapping of a file of
    ``directory``, from /proc/self/maps: what ``mmap=True`` did not map."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).parent == Path(directory):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return [n for n, p in model.named_parameters()
            if not any(a <= local(p).data_ptr() < b for a, b in ranges)]
