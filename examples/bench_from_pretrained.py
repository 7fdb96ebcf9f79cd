"""Loading and saving a HuggingFace Llama on CPU ranks against the storage floor (issue #32).

    python examples/bench_from_pretrained.py [--dir DIR] [--size 12] [--repeat N]
    python examples/bench_from_pretrained.py --ways ... [--cold] [--ranks 2] [--size 22]
    python examples/bench_from_pretrained.py --save [--dir DIR] [--ranks 2] [--ways ...]

Saves a Llama of TinyLlama's width with random fp32 weights via ``save_pretrained`` into
DIR (a temporary directory unless given; reused when it already holds one): ``--size``
decoder layers, 12 by default (0.66B parameters, 2.46 GiB), 22 for TinyLlama's 1.1B.

Without ``--ways`` or ``--save`` it prints issue #32's table in one run: on 2 CPU ranks,
the floor, reading into fresh memory, annot's default and ``mmap=True``, transformers on
every rank, transformers' own FSDP2, torchtitan's way and rank 0 + broadcast, each cold
and warm (``--repeat`` rounds, the median), with each way's peak RSS per rank above its
start against the shard, its first write and its load plus first write (issue #42: what
a run pays before its first step is done), and annot's load plus first write over each
peer's; then
``annot.save`` against ``safetensors.torch.save_file`` of the same tensors (+ fsync) and
the write floor, and a check that annot's files hold the source's tensors bitwise.

With ``--ways`` it loads on N CPU ranks (torchrun, gloo), one launch per way, one table
row per rank:

- ``pread`` (the floor): each rank reads the byte ranges of the rows FSDP2 gives it (dim-0
  chunks, as ``torch.chunk``) with ``os.preadv`` into one preallocated, reused buffer:
  the same bytes as annot reads, with nothing else done;
- ``pread_fresh``: the same reads, each into new memory of its own (``torch.empty`` per
  tensor), as any loader whose weights live in the process's own memory must: the
  floor plus the first touch of that memory;
- ``bound``: the least any FSDP2-sharded mapped load does: the model built on the meta
  device (nothing recorded), ``fully_shard`` on every layer and the root, then each
  rank's rows of every tensor mapped from the file (``torch.from_file``, private) and put in
  as DTensors through ``load_state_dict(assign=True)``; no checks, no Plan, the rotary
  buffer left on the meta device. Not a loader (nothing validated): the time a sharded
  load cannot go below here, to set against transformers' whole-model load;
- ``annot``: ``annot.from_pretrained(DIR, "fsdp2")``: meta model, FSDP2 shards, each rank
  reads only its own rows of every tensor;
- ``annot_mmap``: the same with ``mmap=True``: each rank maps its own rows of every
  tensor (copy-on-write) instead of reading them;
- ``annot_fsdp1``, ``annot_zero3``: ``annot.from_pretrained(DIR, "fsdp1")`` and
  ``(DIR, "deepspeed")`` (ZeRO-3, an SGD optimizer): a rank holds one unit's full tensors
  while the engine shards it, then reads the rows of its flat shard;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)`` on every rank;
- ``transformers_fsdp``: the same with ``distributed_config=DistributedConfig(fsdp_size=N)``:
  transformers shards the model with FSDP2 itself (the same job as annot's rows);
- ``torchtitan``: torchtitan's way of starting from a HuggingFace checkpoint: the model
  built on the meta device, ``fully_shard`` on every decoder layer and the root,
  ``to_empty(device="cpu")``, the rotary buffers computed as torchtitan computes its RoPE
  cache, then ``torch.distributed.checkpoint.load`` of the model's sharded state dict
  through ``HuggingFaceStorageReader(DIR)`` (each rank reads its rows through
  safetensors' map, into a new tensor, then copies them into its shard);
- ``rank0`` (rank 0 + broadcast): rank 0 loads with transformers, the other ranks build the model
  on the meta device, all shard it with FSDP2, and torch's ``set_model_state_dict``
  (``broadcast_from_rank0``) scatters rank 0's tensors (the usual recipe).

With ``--cold`` the files are dropped from the page cache before every launch
(``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, not a system-wide drop: the
machine is shared; the share of the files' pages still resident after it, from
``mincore``, is printed); otherwise
one untimed read warms the cache first. ``--repeat N`` runs N rounds, each way once per
round, and shows each way's median time and its fastest and slowest launch (the
machine's timings drift between launches). After loading, each rank reads one byte of every
page (4 KiB) of every tensor it holds, as a first training step reads them all, so
memory-mapped weights are paged in and counted. Prints one row per rank and way: bytes
read, peak RSS, peak RSS above the process's footprint before loading, and time (loading
and that touch); then, not in that time, "first write": writing every
tensor the rank holds once in place, as the first optimizer step will, which is where a
memory-mapped weight is copied (page by page, on write). Bytes read: the ``rchar`` count of ``/proc/self/io``
(every ``read``/``pread``); transformers reads safetensors through a memory map, which
``rchar`` does not see, so for its rows the column shows the bytes of the tensors it
loaded (with ``fsdp_size``, of the shards it keeps: what it paged in to cut them is not
counted), marked ``*``. Every way imports its modules before the clock starts. The
workers inherit the environment: ``THP_MEM_ALLOC_ENABLE=1`` (torch's switch for asking
Linux for transparent huge pages for every CPU allocation of 2 MiB or more) applies to
every way, and the first line says whether it was set.

With ``--save`` each launch first loads the model (not timed), then times writing all of
it as safetensors into a new folder beside DIR (removed after), one launch per way:

- ``write`` (the floor): rank 0 writes as many bytes as DIR's files hold, 16 MiB at a
  time from one reused page-aligned buffer with ``O_DIRECT`` (the disk's speed, no page
  cache to fill; through the page cache where the filesystem refuses it), then fsyncs;
- ``gather``: every rank calls ``full_tensor()`` on each FSDP2 parameter in turn and
  drops it, nothing written: what gathering alone costs (gloo on CPU here);
- ``annot``, ``annot_fsdp1``, ``annot_zero3``: ``annot.save(model, out)`` of what
  ``annot.from_pretrained(DIR, engine)`` returned for FSDP2, FSDP1, DeepSpeed ZeRO-3;
- ``safetensors``: the usual recipe for the same FSDP2 model: torch's
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` gathers it whole on
  rank 0, which writes it with ``safetensors.torch.save_file``, then fsyncs;
- ``safetensors_whole``: rank 0 already holds the whole model (transformers'
  ``from_pretrained``, not timed) and writes it with ``save_file``, then fsyncs: the
  library's own speed, with no gathering.

Every row's time includes the fsync (annot always syncs its files and folder before it
renames them in; the other rows call ``os.fsync`` on the file they wrote), and "fsync s"
shows how long that call took where the bench makes it. Bytes written: the
``write_bytes`` count of ``/proc/self/io`` (bytes sent towards the disk; the gathers'
socket traffic does not count); GiB/s is the checkpoint's size over the time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WAYS = ("pread", "pread_fresh", "bound", "annot", "annot_mmap", "annot_fsdp1", "annot_zero3", "transformers",
        "transformers_fsdp", "torchtitan", "rank0")
LABELS = {"pread": "floor: pread of the rank's rows",
          "pread_fresh": "pread into fresh memory",
          "bound": "least sharded map: meta, fully_shard, map",
          "annot": "annot.from_pretrained fsdp2",
          "annot_mmap": "annot.from_pretrained fsdp2, mmap=True",
          "annot_fsdp1": "annot.from_pretrained fsdp1",
          "annot_zero3": "annot.from_pretrained ZeRO-3",
          "transformers": "transformers, every rank",
          "transformers_fsdp": "transformers, fsdp_size=N (FSDP2)",
          "torchtitan": "torchtitan's way: meta, fully_shard, to_empty, DCP HF reader",
          "rank0": "rank 0 + broadcast (FSDP2)"}
SAVE_WAYS = ("write", "gather", "annot", "safetensors", "safetensors_whole", "annot_fsdp1",
             "annot_zero3")
SAVE_LABELS = {"write": "floor: O_DIRECT pwrite + fsync, rank 0", "gather": "FSDP2 full_tensor() only",
               "annot": "annot.save fsdp2",
               "safetensors": "full state dict + save_file (FSDP2)",
               "safetensors_whole": "save_file of a whole model, rank 0",
               "annot_fsdp1": "annot.save fsdp1", "annot_zero3": "annot.save ZeRO-3"}
SAVE_ENGINES = {"annot": "fsdp2", "gather": "fsdp2", "safetensors": "fsdp2", "annot_fsdp1": "fsdp1",
                "annot_zero3": "deepspeed"}


def llama_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def save_checkpoint(directory: Path, layers: int) -> int:
    """Save the model once (reused when present); returns its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(layers))
        model.save_pretrained(directory)
        del model
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(layers)).parameters())


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _io(counter: str = "rchar") -> int:
    """This process's ``rchar`` (bytes read) or another counter of ``/proc/self/io`` so far."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith(counter + ":"))


def worker(way: str, directory: str) -> None:
    """One rank of one way; rank 0 prints the ranks' figures as one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import annot

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _import_everything(directory)
    dist.barrier()
    base_rss, base_read, start = _rss_bytes(), _io(), time.perf_counter()
    loaded_bytes = None
    if way in ("pread", "pread_fresh"):
        _pread_rows(Path(directory), rank, dist.get_world_size(), fresh=way == "pread_fresh")
        _finish(rank, base_rss, base_read, start, None)
        return
    if way == "bound":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory),
                                                     dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        _map_own_rows(model, Path(directory))
    elif way in ("annot", "annot_mmap"):
        model = annot.from_pretrained(directory, "fsdp2", mmap=way == "annot_mmap")
    elif way == "annot_fsdp1":
        model = annot.from_pretrained(directory, "fsdp1")
    elif way == "annot_zero3":  # DeepSpeed builds its engine with an optimizer (SGD: no state)
        model = annot.from_pretrained(directory, "deepspeed",
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).model
    elif way == "transformers":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        loaded_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    elif way == "transformers_fsdp":
        from transformers import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32,
            distributed_config=DistributedConfig(fsdp_size=dist.get_world_size()))
    elif way == "torchtitan":
        model = _torchtitan_load(directory)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if rank == 0:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            full = model.state_dict()
            loaded_bytes = sum(t.numel() * t.element_size() for t in full.values())
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
            full = {}
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        del full
    # Read every tensor this rank holds once, as the first training step will: a
    # memory-mapped checkpoint is paged in, and counted in RSS, only when touched.
    tensors = [t for t in _local_tensors(model) if not t.is_meta]
    # Mapped, not read (safetensors' own reads, torchtitan's way, go through a map too):
    # rchar does not see it.
    if way in ("bound", "annot_mmap", "transformers_fsdp", "torchtitan"):
        loaded_bytes = sum(t.nbytes for t in tensors)
    with torch.no_grad():
        for tensor in tensors:
            _touch_pages(tensor)
        dist.barrier()
        seconds = time.perf_counter() - start
        written = time.perf_counter()
        for tensor in tensors:
            tensor.mul_(1.0)
    dist.barrier()
    if way == "torchtitan":
        _check_rotary(model)
    _finish(rank, base_rss, base_read, start, loaded_bytes, seconds=seconds,
            first_write=time.perf_counter() - written)


PAGE = 4096


def _torchtitan_load(directory: str) -> torch.nn.Module:
    """The ``torchtitan`` way: how torchtitan starts from a HuggingFace checkpoint
    (``CheckpointManager.dcp_load`` with ``from_hf``), on transformers' Llama, whose
    state-dict names are the checkpoint's keys (torchtitan's key adapter is then the
    identity). Meta build, ``fully_shard`` on every decoder layer and the root,
    ``to_empty`` on the CPU (each rank allocates its shards, values undefined), the
    rotary buffers (not in the checkpoint) computed as torchtitan computes its RoPE
    cache, then torch's ``dcp.load`` of the model's sharded state dict through
    ``HuggingFaceStorageReader`` with its defaults, as torchtitan builds it (one thread;
    each read item is a ``safe_open(...).get_slice(key)[rows]``, a copy out of the
    file's map into a new tensor, then copied into the shard). torchtitan then hands
    the dict back to ``load_state_dict``; its tensors here are the parameters' own
    storage, so that copy would change nothing and is left out."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    _rotary_as_torchtitan(model, config, torch.device("cpu"))
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory))
    return model


def _rotary_as_torchtitan(model: torch.nn.Module, config, device: torch.device) -> None:
    """Fill the Llama's rotary buffers (``inv_freq`` and its copy ``original_inv_freq``,
    non-persistent, so in no checkpoint) with what torchtitan's RoPE computes for the
    config's theta and head size (plain RoPE: the bench's config scales nothing), on
    ``device`` as its ``init_states(buffer_device=...)`` does; checked equal to
    transformers' own values after the clock (`_check_rotary`)."""
    import torch

    rotary = model.model.rotary_emb
    theta = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with torch.device(device), torch.no_grad():
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        rotary.inv_freq.copy_(freqs)
        rotary.original_inv_freq.copy_(freqs)


def _check_rotary(model: torch.nn.Module) -> None:
    """Raise unless the rotary buffers hold transformers' own values (the torchtitan
    way computes them itself: a wrong formula would load a model that computes wrong)."""
    import torch

    rotary = model.model.rotary_emb
    expected, _ = type(rotary).compute_default_rope_parameters(rotary.config)
    for buffer in (rotary.inv_freq, rotary.original_inv_freq):
        if not torch.equal(buffer, expected):
            raise RuntimeError("torchtitan way: the rotary buffers differ from transformers' values")


def _map_own_rows(model: torch.nn.Module, directory: Path) -> None:
    """Put this rank's rows of every checkpoint tensor, mapped copy-on-write from the file,
    into the FSDP2-sharded meta ``model`` (the ``bound`` way: dim-0 chunks as FSDP2 cuts
    them; nothing checked)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    state = {}
    for file, length, header in _headers(directory):
        data = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
        for name, entry in header.items():
            target = params[name]
            local = target.to_local()
            begin, end = entry["data_offsets"]
            rows = entry["shape"][0]
            first, _ = _rank_rows(rows, target.device_mesh.get_local_rank(), target.device_mesh.size())
            start = 8 + length + begin + first * ((end - begin) // rows)
            part = data[start:start + local.nbytes].view(local.dtype).view(local.shape)
            state[name] = torch.nn.Parameter(DTensor.from_local(
                part, target.device_mesh, target.placements, run_check=False,
                shape=target.shape, stride=target.stride()))
    model.load_state_dict(state, strict=False, assign=True)


def _local_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What this rank holds, each tensor once, whatever shards it: a DTensor's local part
    (FSDP2), FSDP1's views into its flat shard (``use_orig_params``), ZeRO-3's partition
    (``ds_tensor``), a plain tensor itself."""
    out: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor = getattr(tensor, "ds_tensor", tensor)
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        out.setdefault(id(tensor), tensor)
    return list(out.values())


def _touch_pages(tensor: torch.Tensor) -> None:
    """Read one byte of every 4 KiB page of ``tensor`` (contiguous, as every rank's tensors
    are): a mapped page is read in from the file or page cache, as by any first read,
    without the cost of computing on every element (summing 1.93 GiB of fp32 took 0.21 s
    here, which no way's loading includes and the floor never pays)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("touching pages needs a contiguous tensor")
    tensor.detach().reshape(-1).view(torch.uint8)[::PAGE].sum()


def _import_everything(directory: str) -> None:
    """Import, before the clock starts, what any way imports lazily (transformers' model
    and loading modules, DTensor, annot's loading path): the table compares loading, and
    these imports took 5-8 s of a first call here, the same for every way."""
    import importlib

    from transformers import AutoConfig

    AutoConfig.from_pretrained(directory)
    for module in ("transformers.models.llama.modeling_llama", "transformers.core_model_loading",
                   "transformers.conversion_mapping", "torch.distributed.tensor",
                   "torch.distributed.checkpoint.state_dict", "torch.distributed.checkpoint.hf_storage",
                   "safetensors", "annot.huggingface.pretrained",
                   "annot.wrap", "annot.engines.fsdp2", "annot.checkpoint_io.loading"):
        importlib.import_module(module)


def _headers(directory: Path) -> list[tuple[Path, int, dict]]:
    """Each safetensors file of ``directory``: its path, header length and tensor entries."""
    out = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        out.append((file, length, header))
    return out


def _rank_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The dim-0 rows ``[first, last)`` FSDP2 gives ``rank`` of ``world`` (``torch.chunk``)."""
    per_rank = -(-rows // world)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


def _pread_rows(directory: Path, rank: int, world: int, fresh: bool = False) -> None:
    """Read this rank's dim-0 rows of every tensor into one reused buffer (``fresh``: into
    a new buffer per tensor, all kept)."""
    import torch

    ranges = []
    for file, length, header in _headers(directory):
        for entry in header.values():
            begin, end = entry["data_offsets"]
            rows = entry["shape"][0] if entry["shape"] else 1
            row_bytes = (end - begin) // rows if rows else 0
            first, last = _rank_rows(rows, rank, world)
            if last > first:
                ranges.append((file, 8 + length + begin + first * row_bytes, (last - first) * row_bytes))
    buffer = bytearray(max(n for _, _, n in ranges))
    view = memoryview(buffer)
    kept = []
    fds = {file: os.open(file, os.O_RDONLY) for file, _, _ in ranges}
    try:
        for file, offset, n in ranges:
            if fresh:
                kept.append(torch.empty(n, dtype=torch.uint8))
                view = kept[-1].numpy().data.cast("B")
            done = 0
            while done < n:
                done += os.preadv(fds[file], [view[done:n]], offset + done)
    finally:
        for fd in fds.values():
            os.close(fd)


def _finish(rank: int, base_rss: int, base_io: int, start: float, loaded_bytes: int | None,
            counter: str = "rchar", fsync: float | None = None, seconds: float | None = None,
            first_write: float | None = None) -> None:
    """Gather the ranks' figures; the time is from ``start`` to now (after a barrier)
    unless ``seconds`` was measured already."""
    import torch.distributed as dist

    dist.barrier()
    elapsed = time.perf_counter() - start if seconds is None else seconds
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {"rank": rank, "read": _io(counter) - base_io, "loaded_bytes": loaded_bytes,
           "peak": peak, "above": peak - base_rss, "seconds": elapsed, "fsync": fsync,
           "first_write": first_write}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


def save_worker(way: str, directory: str, out: str) -> None:
    """One rank of one save way: load (not timed), then save into ``out``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import annot

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _import_everything(directory)
    import safetensors.torch  # noqa: F401 - imported before the clock, as every module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = whole = None
    if way in SAVE_ENGINES:
        # DeepSpeed builds its engine with an optimizer (SGD: no state to allocate).
        extra = {"optimizer": lambda p: torch.optim.SGD(p, lr=0.1)} if way == "annot_zero3" else {}
        model = annot.from_pretrained(directory, SAVE_ENGINES[way], **extra)
    elif way == "safetensors_whole" and rank == 0:
        whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    dist.barrier()
    base_rss, base_written, start = _rss_bytes(), _io("write_bytes"), time.perf_counter()
    fsync = None
    if way == "write":
        if rank == 0:
            fsync = _write_floor(Path(directory), Path(out))
    elif way == "safetensors":
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            fsync = _save_file(full, Path(out))
        del full
    elif way == "safetensors_whole":
        if rank == 0:
            fsync = _save_file(whole, Path(out))
    elif way == "gather":
        for tensor in model.state_dict().values():
            tensor.full_tensor()
    else:
        annot.save(model, out)
    _finish(rank, base_rss, base_written, start, None, counter="write_bytes", fsync=fsync)


def _fsync_file(path: Path) -> float:
    """fsync ``path``; returns the seconds it took."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _save_file(state: dict, out: Path) -> float:
    import safetensors.torch

    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return _fsync_file(out / "model.safetensors")


def _write_floor(directory: Path, out: Path) -> float:
    """Write as many bytes as ``directory``'s checkpoint holds, from one reused
    page-aligned buffer, with ``O_DIRECT`` (the disk's own speed: no page cache to fill)
    where the filesystem allows, else through the page cache; then fsync. Returns the
    fsync's seconds."""
    import mmap

    from annot.checkpoint_io.direct_write import ALIGN, CHUNK

    total = sum(8 + length + sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
                for _, length, header in _headers(directory))
    buffer = mmap.mmap(-1, CHUNK)
    buffer.write(b"\1" * CHUNK)  # touched before the clock's work
    path = out / "model.safetensors"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        while offset < total:
            n = min(CHUNK, -(-(total - offset) // ALIGN) * ALIGN)  # whole blocks, the last padded
            done = 0
            while done < n:
                done += os.pwrite(fd, memoryview(buffer)[done:n], offset + done)
            offset += n
        os.ftruncate(fd, total)
    finally:
        os.close(fd)
    return _fsync_file(path)


def launch(way: str, directory: Path, ranks: int, timeout: int, out: Path | None = None) -> list[dict]:
    with socket.socket() as sock:  # a free port for this launch
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--worker", way,
           "--dir", str(directory)] + (["--save", "--out", str(out)] if out is not None else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{way} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def drop_from_page_cache(files: list[Path]) -> None:
    """Ask the kernel to drop these files' cached pages (this machine's other files stay)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(x[i]) for x in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def load_table(args: argparse.Namespace, directory: Path, ways: list[str]) -> None:
    """One launch per way, ``--repeat`` rounds (every way once per round, so a slow spell
    of the machine falls on all of them); with more than one round each row shows the
    median time and, beside it, the fastest and slowest launch."""
    runs: dict[tuple[str, int], list[dict]] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not args.cold:
        for file in files:  # warm: every way finds the files in the page cache
            with open(file, "rb") as f:
                while f.read(2**26):
                    pass
    for _ in range(args.repeat):
        for way in ways:
            if args.cold:
                drop_from_page_cache(files)
            for r in launch(way, directory, args.ranks, args.timeout):
                runs.setdefault((way, r["rank"]), []).append(r)
    floor = {rank: statistics.median([r["seconds"] for r in rs]) for (way, rank), rs in runs.items()
             if way == ways[0]}
    rows = []
    for (way, rank), rs in runs.items():
        r = rs[0]
        nbytes = r["read"] if r["loaded_bytes"] is None else r["loaded_bytes"]
        read = gib(nbytes) if r["loaded_bytes"] is None else f"{gib(nbytes)}*"
        seconds = statistics.median([r["seconds"] for r in rs])
        spread = f"{min(r['seconds'] for r in rs):.2f}-{max(r['seconds'] for r in rs):.2f}"
        writes = [r["first_write"] for r in rs if r["first_write"] is not None]
        rows.append((LABELS[way], str(rank), read, gib(max(r["peak"] for r in rs)),
                     gib(max(r["above"] for r in rs)), f"{seconds:.2f} s",
                     *([spread] if args.repeat > 1 else []),
                     f"{nbytes / 2**30 / seconds:.2f}", f"{seconds / floor[rank]:.2f}",
                     f"{statistics.median(writes):.2f} s" if writes else "-"))
    print_table(("way", "rank", "bytes read", "peak RSS", "above start",
                 "time" if args.repeat == 1 else f"median of {args.repeat}",
                 *(["fastest-slowest"] if args.repeat > 1 else []),
                 "GiB/s", "x floor", "first write"), rows)
    print("* memory-mapped reads: the bytes of the tensors loaded, not an rchar count")
    print("first write: every tensor the rank holds written once, after the timed load "
          "(a mapped page is copied then)")
    if args.repeat > 1:
        print("peak RSS and above start: the largest of the launches")


ISSUE_WAYS = ("pread", "pread_fresh", "annot", "annot_mmap", "transformers", "transformers_fsdp",
              "torchtitan", "rank0")
ISSUE_SAVE_WAYS = ("write", "safetensors_whole", "annot")


def resident_share(files: list[Path]) -> float:
    """The share of ``files``' pages in the page cache now (``mincore`` of a map of each)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    resident = total = 0
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as f:  # private and writable only so ctypes can take its address
            region = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        start = ctypes.c_char.from_buffer(region)
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
        del start
        region.close()
        if failed:
            return float("nan")
        resident += sum(v & 1 for v in vector)
        total += pages
    return resident / total if total else 0.0


def issue_table(args: argparse.Namespace, directory: Path, file_bytes: int) -> None:
    """Issue #32's table: every load way cold and warm (``--repeat`` rounds, medians),
    then the save ways; one launch per way and state."""
    files = sorted(directory.glob("*.safetensors"))
    shard = file_bytes / args.ranks
    times: dict[tuple[str, str], list[float]] = {}
    above: dict[str, int] = {}
    writes: dict[tuple[str, str], list[float]] = {}
    # Each launch's load plus its first write (what a run pays before its first step is
    # done), summed per launch so the median is of one launch's whole cost.
    totals: dict[tuple[str, str], list[float]] = {}
    residents = []
    for _ in range(args.repeat):
        for state in ("cold", "warm"):
            for way in ISSUE_WAYS:
                if state == "cold":
                    drop_from_page_cache(files)
                    residents.append(resident_share(files))
                else:
                    for file in files:  # every warm way finds the files in the page cache
                        with open(file, "rb") as f:
                            while f.read(2**26):
                                pass
                rows = launch(way, directory, args.ranks, args.timeout)
                seconds = max(r["seconds"] for r in rows)
                times.setdefault((way, state), []).append(seconds)
                if rows[0]["first_write"] is not None:
                    write = max(r["first_write"] for r in rows)
                    writes.setdefault((way, state), []).append(write)
                    totals.setdefault((way, state), []).append(seconds + write)
                above[way] = max(above.get(way, 0), *(r["above"] for r in rows))
    median = {key: statistics.median(v) for key, v in times.items()}
    print(f"\nLoad, {args.ranks} CPU ranks, slowest rank's time, median of {args.repeat}; "
          f"cold: posix_fadvise(DONTNEED) per file, {100 * max(residents):.1f}% of the pages "
          f"still resident after it at most; shard {gib(shard)} per rank; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) at the end")
    rows = []
    for way in ISSUE_WAYS:
        cells = [LABELS[way]]
        for state in ("cold", "warm"):
            seconds = median[(way, state)]
            cells.append(f"{seconds:.2f} s ({seconds / median[('pread', state)]:.1f}x)")
        cells += [gib(above[way]), f"{above[way] / shard:.2f}",
                  _pair(writes, way), _pair(totals, way)]
        rows.append(tuple(cells))
    print_table(("way", "cold (x floor)", "warm (x floor)", "peak RSS above start / rank",
                 "/ shard", "first write (cold / warm)", "load + first write (cold / warm)"), rows)
    print("first write: every tensor a rank holds written once after the load (not in its "
          "time), as a first optimizer step does: where a mapped weight is copied")
    _print_against_peers(totals)
    save_rows = []
    for way in ISSUE_SAVE_WAYS:
        out = Path(tempfile.mkdtemp(prefix="annot-bench-save-", dir=directory.parent))
        try:
            results = launch(way, directory, args.ranks, args.timeout, out=out)
            if way == "annot":
                same = same_tensors(directory, out)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        save_rows.append((SAVE_LABELS[way], f"{max(r['seconds'] for r in results):.2f} s"))
    base = float(save_rows[1][1].split()[0])
    save_rows = [(label, f"{t} ({float(t.split()[0]) / base:.2f}x save_file)") for label, t in save_rows]
    print(f"\nSave, {args.ranks} CPU ranks, every file fsynced; slowest rank")
    print_table(("way", "time"), save_rows)
    print(f"annot.save's files hold the source's tensors bitwise: {same}")


def _pair(values: dict[tuple[str, str], list[float]], way: str) -> str:
    """``way``'s cold and warm medians of ``values``, or ``-`` where it has none."""
    if (way, "cold") not in values:
        return "-"
    return " / ".join(f"{statistics.median(values[(way, state)]):.2f} s" for state in ("cold", "warm"))


def _print_against_peers(totals: dict[tuple[str, str], list[float]]) -> None:
    """annot's default load + first write over each other loader's (issue #42: at most
    1.00 for every peer, cold and warm, in one run)."""
    peers = [way for way in ISSUE_WAYS  # the floors read nothing into a model; mmap is annot's own
             if way not in ("pread", "pread_fresh", "annot", "annot_mmap") and (way, "cold") in totals]
    cells = []
    for way in peers:
        ratios = [statistics.median(totals[("annot", state)]) / statistics.median(totals[(way, state)])
                  for state in ("cold", "warm")]
        cells.append(f"{LABELS[way]} {ratios[0]:.2f} / {ratios[1]:.2f}")
    print("annot's default load + first write over each peer's (cold / warm): " + "; ".join(cells))


def same_tensors(source: Path, saved: Path) -> bool:
    """Whether the safetensors of ``saved`` hold exactly ``source``'s tensors (names,
    dtypes, shapes, bytes), read one tensor at a time with the safetensors library."""
    import torch
    from safetensors import safe_open

    def tensors(directory: Path) -> dict[str, Path]:
        return {key: file for file in directory.glob("*.safetensors")
                for key in safe_open(str(file), "pt").keys()}

    left, right = tensors(source), tensors(saved)
    if set(left) != set(right):
        return False
    for key, file in left.items():
        with safe_open(str(file), "pt") as a, safe_open(str(right[key]), "pt") as b:
            x, y = a.get_tensor(key), b.get_tensor(key)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


def save_table(args: argparse.Namespace, directory: Path, ways: list[str], file_bytes: int) -> None:
    rows = []
    floor: dict[int, float] = {}
    for way in ways:
        out = Path(tempfile.mkdtemp(prefix="annot-bench-save-", dir=directory.parent))
        try:
            results = launch(way, directory, args.ranks, args.timeout, out=out)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        for r in results:
            floor.setdefault(r["rank"], r["seconds"])
            rows.append((SAVE_LABELS[way], str(r["rank"]), gib(r["read"]), gib(r["peak"]),
                         gib(r["above"]), f"{r['seconds']:.2f} s",
                         "-" if r["fsync"] is None else f"{r['fsync']:.2f}",
                         f"{file_bytes / 2**30 / r['seconds']:.2f}",
                         f"{r['seconds'] / floor[r['rank']]:.2f}"))
    print_table(("way", "rank", "bytes written", "peak RSS", "above start", "time (with fsync)",
                 "fsync s", "GiB/s", "x floor"), rows)
    print("GiB/s: the checkpoint's size over the time; annot's own fsyncs are inside its time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint directory (made if absent)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", type=int, default=12,
                        help="decoder layers: 12 gives 2.46 GiB (the issue's model), 22 1.10B parameters")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before every launch")
    parser.add_argument("--save", action="store_true", help="time saving instead of loading")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of loads (every way once per round); the table shows medians")
    parser.add_argument("--ways", help="comma-separated subset of the ways (the floor first)")
    parser.add_argument("--worker", choices=sorted({*WAYS, *SAVE_WAYS}), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.save:
            save_worker(args.worker, str(args.dir), args.out)
        else:
            worker(args.worker, str(args.dir))
        # Figures printed, process group down: skip the interpreter's native teardown, where
        # about one launch in ten aborted here ("terminate called without an active
        # exception", in the `bound` way too, which runs no annot code), failing a run
        # whose figures were already out. An error above still exits non-zero.
        sys.stdout.flush()
        os._exit(0)
    if args.repeat < 1 or (args.save and args.repeat != 1):
        parser.error("--repeat takes a number >= 1, and applies to loads only")
    known = SAVE_WAYS if args.save else WAYS
    ways = args.ways.split(",") if args.ways else list(known)
    if args.cold and not args.ways:
        parser.error("--cold applies to --ways; the default table runs cold and warm")
    if unknown := [w for w in ways if w not in known]:
        parser.error(f"unknown ways {unknown}; choose from {', '.join(known)}")

    temporary = args.dir is None
    directory = args.dir or Path(tempfile.mkdtemp(prefix="annot-bench-"))
    try:
        params = save_checkpoint(directory, args.size)
        file_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"Llama, {params / 1e9:.2f}B parameters, fp32 safetensors {gib(file_bytes)} "
              f"in {directory}; {args.ranks} CPU ranks (gloo); ideal shard "
              f"{gib(file_bytes / args.ranks)}; torch's huge-page allocation "
              f"(THP_MEM_ALLOC_ENABLE) {'on' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else 'off'}")
        if args.save:
            save_table(args, directory, ways, file_bytes)
        elif args.ways:
            load_table(args, directory, ways)
        else:
            issue_table(args, directory, file_bytes)
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
