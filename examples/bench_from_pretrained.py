"""Per-rank bytes read and peak memory while loading a >= 1B-parameter HuggingFace checkpoint.

    python examples/bench_from_pretrained.py [--dir DIR] [--ranks 2] [--layers 22]

Saves a Llama of about 1.1B parameters (TinyLlama's shape) with random fp32 weights via
``save_pretrained`` into DIR (a temporary directory unless given; reused when it already
holds one), then loads it on N CPU ranks (torchrun, gloo), one launch per way:

- ``annot``: ``annot.from_pretrained(DIR, "fsdp2")``: meta model, FSDP2 shards, each rank
  reads only its own rows of every tensor;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)`` on every rank;
- ``rank 0 + broadcast``: rank 0 loads with transformers, the other ranks build the model
  on the meta device, all shard it with FSDP2, and torch's ``set_model_state_dict``
  (``broadcast_from_rank0``) scatters rank 0's tensors (the usual recipe).

After loading, each rank reads every tensor it holds once (as a first training step
would), so memory-mapped weights are paged in and counted. Prints one row per rank and
way: bytes read, peak RSS, peak RSS above the process's footprint before loading, and
time (loading and that one read). Bytes read: the ``rchar`` count of ``/proc/self/io``
(every ``read``/``pread``); transformers reads safetensors through a memory map, which
``rchar`` does not see, so for its rows the column shows the bytes of the tensors it
loaded, marked ``*``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("annot", "transformers", "rank0")
LABELS = {"annot": "annot.from_pretrained fsdp2", "transformers": "transformers, every rank",
          "rank0": "rank 0 + broadcast (FSDP2)"}


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
    dist.barrier()
    base_rss, base_read, start = _rss_bytes(), _rchar(), time.perf_counter()
    loaded_bytes = None
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


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint directory (made if absent)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=22, help="22 gives 1.10B parameters")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
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
        header = ("way", "rank", "bytes read", "peak RSS", "above start", "time")
        rows = []
        for way in WAYS:
            for r in launch(way, directory, args.ranks, args.timeout):
                read = gib(r["read"]) if r["loaded_bytes"] is None else f"{gib(r['loaded_bytes'])}*"
                rows.append((LABELS[way], str(r["rank"]), read, gib(r["peak"]), gib(r["above"]),
                             f"{r['seconds']:.1f} s"))
        widths = [max(len(x[i]) for x in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        print("* memory-mapped reads: the bytes of the tensors loaded, not an rchar count")
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
