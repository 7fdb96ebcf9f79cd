"""Loading a mixture-of-experts checkpoint written by transformers 5 (one key per expert)
against a dense one of about the same size, per rank, with FSDP2.

    python examples/bench_moe_load.py [--dir DIR] [--ranks 2] [--experts 32] [--hidden 512] [--layers 4]

Saves with ``save_pretrained`` into DIR (a temporary directory unless given; reused when
it already holds them) a Qwen3-MoE of random fp32 weights (``--experts`` experts of
``--hidden // 2`` intermediate size per layer) and a dense Qwen3 whose MLP has as many
parameters, then launches ``annot.from_pretrained(DIR/<model>, "fsdp2")`` on N CPU ranks
(torchrun, gloo), one launch per model. Prints, per rank: bytes read (``rchar`` of
``/proc/self/io``), the bytes of the rank's shard, of the largest tensor, peak RSS above
the footprint before loading (``VmHWM`` minus ``VmRSS`` at start), the load time, and
time per GiB read; the MoE's fused experts are read as the experts each rank's rows cover
(annot.formats.transformers_conversions). One untimed read of every file warms the page cache
first. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def configs(experts: int, hidden: int, layers: int) -> dict:
    import transformers

    common = dict(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=256)
    moe = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=hidden // 2, intermediate_size=hidden,
                                      num_experts=experts, num_experts_per_tok=2)
    # The dense MLP holds the same parameters as all experts: 3 matrices of hidden x I.
    dense = transformers.Qwen3Config(**common, intermediate_size=experts * hidden // 2)
    return {"moe": (moe, transformers.Qwen3MoeForCausalLM), "dense": (dense, transformers.Qwen3ForCausalLM)}


def save_all(root: Path, experts: int, hidden: int, layers: int) -> None:
    import torch

    for name, (config, cls) in configs(experts, hidden, layers).items():
        if not (root / name / "config.json").exists():
            torch.manual_seed(0)
            cls(config).save_pretrained(root / name)


def _reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: ``5`` into ``/proc/self/clear_refs``),
    so the peak counts the load only; elsewhere the footprint before the load stays in it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def worker(directory: str) -> None:
    import torch.distributed as dist

    import annot

    dist.init_process_group("gloo")
    for file in Path(directory).glob("*.safetensors"):  # warm the page cache, untimed,
        with open(file, "rb", buffering=0) as f:  # in pieces: a whole-file read would be
            while f.read(2**24):  # the process's peak RSS (VmHWM) before the load began
                pass
    _reset_peak_rss()
    import transformers  # noqa: F401  (imported before the clock starts)

    dist.barrier()
    rss, rchar, start = _status("VmRSS"), _rchar(), time.perf_counter()
    model = annot.from_pretrained(directory, "fsdp2")
    elapsed, read = time.perf_counter() - start, _rchar() - rchar
    peak = _status("VmHWM") - rss
    shard = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (dist.get_rank(), read, shard, largest, peak, elapsed))
    if dist.get_rank() == 0:
        gib = 2**30
        print(f"{Path(directory).name:>6} rank  read GiB  shard GiB  largest MiB  peak RSS GiB  "
              "(shard+largest)*1.1  load s  s/GiB read")
        for rank, read_, shard_, largest_, peak_, elapsed_ in rows:
            print(f"{'':>6} {rank:>4}  {read_ / gib:8.3f}  {shard_ / gib:9.3f}  {largest_ / 2**20:11.1f}  "
                  f"{peak_ / gib:12.3f}  {(shard_ + largest_) * 1.1 / gib:19.3f}  {elapsed_:6.2f}  "
                  f"{elapsed_ / max(read_ / gib, 1e-9):10.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-moe-"))
    save_all(root, args.experts, args.hidden, args.layers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    for name in ("dense", "moe"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
                        __file__, "--worker", str(root / name)], check=True, env=env)


if __name__ == "__main__":
    main()
