"""Per-rank bytes read and peak memory while loading a >= 1B-parameter HuggingFace checkpoint.

    python examples/bench_from_pretrained.py [--dir DIR] [--ranks 2] [--layers 22] [--cold]

Saves a Llama of about 1.1B parameters (TinyLlama's shape) with random fp32 weights via
``save_pretrained`` into DIR (a temporary directory unless given; reused when it already
holds one), then loads it on N CPU ranks (torchrun, gloo), one launch per way:

- ``pread`` (the floor): each rank reads the byte ranges of the rows FSDP2 gives it (dim-0
  chunks, as ``torch.chunk``) with ``os.preadv`` into one preallocated, reused buffer:
  the same bytes as annot reads, with nothing else done;
- ``annot``: ``annot.from_pretrained(DIR, "fsdp2")``: meta model, FSDP2 shards, each rank
  reads only its own rows of every tensor;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)`` on every rank;
- ``rank 0 + broadcast``: rank 0 loads with transformers, the other ranks build the model
  on the meta device, all shard it with FSDP2, and torch's ``set_model_state_dict``
  (``broadcast_from_rank0``) scatters rank 0's tensors (the usual recipe).

With ``--cold`` the files are dropped from the page cache before every launch
(``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, not a system-wide drop); otherwise
one untimed read warms the cache first. After loading, each rank reads every tensor it holds once (as a first training step
would), so memory-mapped weights are paged in and counted. Prints one row per rank and
way: bytes read, peak RSS, peak RSS above the process's footprint before loading, and
time (loading and that one read). Bytes read: the ``rchar`` count of ``/proc/self/io``
(every ``read``/``pread``); transformers reads safetensors through a memory map, which
``rchar`` does not see, so for its rows the column shows the bytes of the tensors it
loaded, marked ``*``. Every way imports its modules before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("pread", "annot", "transformers", "rank0")
LABELS = {"pread": "floor: pread of the rank's rows", "annot": "annot.from_pretrained fsdp2",
          "transformers": "transformers, every rank", "rank0": "rank 0 + broadcast (FSDP2)"}


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


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


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
    base_rss, base_read, start = _rss_bytes(), _rchar(), time.perf_counter()
    loaded_bytes = None
    if way == "pread":
        _pread_rows(Path(directory), rank, dist.get_world_size())
        _finish(rank, base_rss, base_read, start, None)
        return
    if way == "annot":
        model = annot.from_pretrained(directory, "fsdp2")
    elif way == "transformers":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        loaded_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
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
    with torch.no_grad():
        for tensor in model.state_dict().values():
            (tensor.to_local() if hasattr(tensor, "to_local") else tensor).sum()
    _finish(rank, base_rss, base_read, start, loaded_bytes)


def _import_everything(directory: str) -> None:
    """Import, before the clock starts, what any way imports lazily (transformers' model
    and loading modules, DTensor, annot's loading path): the table compares loading, and
    these imports took 5-8 s of a first call here, the same for every way."""
    import importlib

    from transformers import AutoConfig

    AutoConfig.from_pretrained(directory)
    for module in ("transformers.models.llama.modeling_llama", "transformers.core_model_loading",
                   "transformers.conversion_mapping", "torch.distributed.tensor",
                   "torch.distributed.checkpoint.state_dict", "annot.huggingface.pretrained",
                   "annot.wrap", "annot.engines.fsdp2", "annot.checkpoint_io.loading"):
        importlib.import_module(module)


def _pread_rows(directory: Path, rank: int, world: int) -> None:
    """Read this rank's dim-0 rows of every tensor into one reused buffer."""
    ranges = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for entry in header.values():
            begin, end = entry["data_offsets"]
            rows = entry["shape"][0] if entry["shape"] else 1
            per_rank = -(-rows // world)
            row_bytes = (end - begin) // rows if rows else 0
            first, last = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
            if last > first:
                ranges.append((file, 8 + length + begin + first * row_bytes, (last - first) * row_bytes))
    buffer = bytearray(max(n for _, _, n in ranges))
    view = memoryview(buffer)
    fds = {file: os.open(file, os.O_RDONLY) for file, _, _ in ranges}
    try:
        for file, offset, n in ranges:
            done = 0
            while done < n:
                done += os.preadv(fds[file], [view[done:n]], offset + done)
    finally:
        for fd in fds.values():
            os.close(fd)


def _finish(rank: int, base_rss: int, base_read: int, start: float, loaded_bytes: int | None) -> None:
    import torch.distributed as dist

    dist.barrier()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {"rank": rank, "read": _rchar() - base_read, "loaded_bytes": loaded_bytes,
           "peak": peak, "above": peak - base_rss, "seconds": elapsed}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


def launch(way: str, directory: Path, ranks: int, timeout: int) -> list[dict]:
    with socket.socket() as sock:  # a free port for this launch
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--worker", way,
           "--dir", str(directory)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint directory (made if absent)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=22, help="22 gives 1.10B parameters")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before every launch")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, str(args.dir))

    temporary = args.dir is None
    directory = args.dir or Path(tempfile.mkdtemp(prefix="annot-bench-"))
    try:
        params = save_checkpoint(directory, args.layers)
        file_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"Llama, {params / 1e9:.2f}B parameters, fp32 safetensors {gib(file_bytes)} "
              f"in {directory}; {args.ranks} CPU ranks (gloo); ideal shard "
              f"{gib(file_bytes / args.ranks)}")
        header = ("way", "rank", "bytes read", "peak RSS", "above start", "time", "GiB/s", "x floor")
        rows = []
        floor: dict[int, float] = {}
        files = sorted(directory.glob("*.safetensors"))
        if not args.cold:
            for file in files:  # warm: every way finds the files in the page cache
                with open(file, "rb") as f:
                    while f.read(2**26):
                        pass
        for way in WAYS:
            if args.cold:
                drop_from_page_cache(files)
            for r in launch(way, directory, args.ranks, args.timeout):
                nbytes = r["read"] if r["loaded_bytes"] is None else r["loaded_bytes"]
                read = gib(nbytes) if r["loaded_bytes"] is None else f"{gib(nbytes)}*"
                floor.setdefault(r["rank"], r["seconds"])
                rows.append((LABELS[way], str(r["rank"]), read, gib(r["peak"]), gib(r["above"]),
                             f"{r['seconds']:.2f} s", f"{nbytes / 2**30 / r['seconds']:.2f}",
                             f"{r['seconds'] / floor[r['rank']]:.2f}"))
        widths = [max(len(x[i]) for x in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        print("* memory-mapped reads: the bytes of the tensors loaded, not an rchar count")
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
