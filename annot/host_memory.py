"""How much host memory annot may pin (page-lock) on this node, and the one rule for it.

Pinned memory cannot be swapped or reclaimed by the page cache, and the kernel refuses
(or the node's OOM killer answers) an allocation that pins too much of it: pinning every
fp32 state of a 7B-parameter ZeRO-Offload run (16 bytes a parameter, 112 GB) leaves
nothing of a 128 GB host (issue #30; docs/design.md, pitfall 44). So everything annot
pins (offloaded parameters and optimizer state, activation-offload buffers) asks
`pin_host_memory` first: pin when the bytes fit this rank's share of
`PINNED_FRACTION` of the host's memory, else warn (naming what, how much, and the cost:
pageable host-to-device copies are synchronous and slower) and stay pageable.

The host's memory is the smaller of ``/proc/meminfo``'s ``MemTotal`` (else
``os.sysconf``) and the cgroup limit a container sets (``/sys/fs/cgroup/memory.max``,
cgroup v2), shared by torchrun's ``LOCAL_WORLD_SIZE`` ranks on the node.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from annot.devices import local_world_size

__all__ = ["PINNED_FRACTION", "host_memory_bytes", "pin_host_memory", "pinned_budget", "release_freed_heap"]

#: The share of the host's memory all ranks of a node may pin together: the rest stays
#: for the pageable state (optimizer on the host, data loaders, the page cache of loads).
PINNED_FRACTION = 0.5

_MEMINFO = Path("/proc/meminfo")
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")
GIB = 2**30


def _meminfo_total(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_total() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def host_memory_bytes() -> int | None:
    """The bytes of memory this node gives the process (``None`` where nothing says)."""
    total = _meminfo_total(_MEMINFO) or _sysconf_total()
    limit = _cgroup_limit(_CGROUP_LIMIT)
    known = [b for b in (total, limit) if b]
    return min(known) if known else None


def pinned_budget() -> int | None:
    """The bytes this rank may pin: `PINNED_FRACTION` of the host's memory divided among
    torchrun's ranks on the node (``None``: the host's size is unknown, no limit)."""
    total = host_memory_bytes()
    if total is None:
        return None
    return int(total * PINNED_FRACTION) // max(1, local_world_size() or 1)


def pin_host_memory(nbytes: int, what: str, *, device: torch.device | str | None = None,
                    warn: bool = True) -> bool:
    """Whether to pin ``nbytes`` of host memory for ``what`` (a phrase: "FSDP2's
    offloaded parameters and gradients").

    False where there is nothing to pin for (``device`` is not CUDA, or no CUDA is
    available when ``device`` is ``None``), and False with a warning (unless ``warn`` is
    off) when ``nbytes`` exceed `pinned_budget`: the caller keeps that memory pageable.
    """
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if not on_cuda:
        return False
    budget = pinned_budget()
    if budget is None or nbytes <= budget:
        return True
    if warn:
        warnings.warn(
            f"{what} need {nbytes / GIB:.1f} GiB of host memory, more than this rank's pinned "
            f"budget of {budget / GIB:.1f} GiB ({PINNED_FRACTION:.0%} of the host's "
            f"{(host_memory_bytes() or 0) / GIB:.1f} GiB shared by {local_world_size() or 1} "
            "rank(s)): kept in pageable memory, so copies between host and GPU are "
            "synchronous and slower. Use more ranks or nodes, or a host with more memory, to "
            "pin it.", stacklevel=2)
    return False


def release_freed_heap() -> bool:
    """Give the pages of freed heap memory back to the kernel (glibc's ``malloc_trim``);
    returns whether anything was given back (``False`` without glibc).

    After a large temporary is freed, glibc raises its threshold for serving requests
    from a memory map, so the next temporaries of a few MiB come from the heap, and the
    heap keeps freed pages that a live block above them pins: quantizing a 133M-weight
    Llama layer by layer left 0.31 GiB resident above the start on one rank where the
    other had 0.13 (docs/design.md, pitfall 65). Costs a walk of the heap: call it after
    a batch of temporaries (a unit), not after each."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
