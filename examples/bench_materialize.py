"""Build a GPT sharded over N ranks several ways and count what each rank allocates.

    python examples/bench_materialize.py --ranks 2 --n_layer 24 --n_embd 2048   # ~1.3B fp32

``--device cuda|cpu`` and ``--backend BACKEND`` choose where the ranks build (default, as
`annot.init_distributed` picks: each rank's GPU with NCCL where there are GPUs, else the
CPU with gloo). The peak is resident memory on the CPU, allocated GPU memory on a GPU.

Methods, each in its own torchrun launch (so peak RSS is per method):
  annot      annot.meta_init -> fully_shard per block -> annot.materialize
  annot_fsdp1  annot.meta_init -> annot.auto_wrap(engine="fsdp1"): FSDP1 allocates one
             unit at a time while it shards, then annot.materialize fills the shards
  annot_zero3  annot.meta_init -> what auto_wrap(engine="deepspeed") does before
             deepspeed.initialize: each block allocated and partitioned by
             deepspeed.zero.Init(module=block) in turn, then annot.materialize
  eager      build on the CPU (whole model on every rank) -> fully_shard
  fsdp2      the bare FSDP2 recipe: meta device -> fully_shard -> to_empty -> reset_parameters
  zero_init  deepspeed.zero.Init (ZeRO-3 partitioning at construction)
  load       annot.meta_init -> fully_shard -> annot.load of a safetensors file of the model
Per rank: peak RSS above the process's baseline (after imports), wall time, and whether
the full parameters equal a 1-rank eager build with the same seed. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_peak(device) -> int:
    """The high-water mark of what this rank holds: its RSS, or its GPU's allocated bytes."""
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_peak()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(ROOT))
    import annot
    from examples.gpt.model import GPT

    shape = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                 vocab_size=args.vocab_size, block_size=args.block_size)
    device = annot.init_distributed(args.backend, device=args.device)
    if args.method in ("zero_init", "annot_zero3"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps torch's group
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    baseline = memory_peak(device)
    start = time.perf_counter()
    torch.manual_seed(0)

    def shard(model):
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    if args.method == "annot":
        with annot.meta_init():
            model = GPT(**shape)
        annot.materialize(shard(model))
    elif args.method == "annot_fsdp1":
        with annot.meta_init():
            model = GPT(**shape)
        wrapped = annot.auto_wrap(model, "fsdp1", checkpoint=False, device=device)
    elif args.method == "annot_zero3":
        import deepspeed

        from annot.engines.deepspeed import partition_unit_by_unit

        with annot.meta_init():
            model = GPT(**shape)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        units = [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
        partition_unit_by_unit(model, units, config, device)
        annot.materialize(model)
    elif args.method == "load":
        with annot.meta_init():
            model = GPT(**shape)
        report = annot.load(shard(model), args.checkpoint)
    elif args.method == "eager":
        model = shard(GPT(**shape))
    elif args.method == "fsdp2":
        with torch.device("meta"):
            model = GPT(**shape)
        shard(model).to_empty(device=device)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    elif args.method == "zero_init":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(**shape)
    seconds = time.perf_counter() - start
    peak = memory_peak(device) - baseline
    result = {"rank": rank, "peak": peak, "seconds": seconds}
    if args.method == "load":
        result["bytes_read"] = report.bytes_read
    if args.compare and args.method == "annot_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        reference = torch.load(args.compare, mmap=True)
        with FullyShardedDataParallel.summon_full_params(wrapped):  # after the peak was taken
            result["equal_1rank"] = all(
                torch.equal(param.cpu(), reference[name.replace("_fsdp_wrapped_module.", "")])
                for name, param in model.named_parameters())
    elif args.compare:
        reference = torch.load(args.compare, mmap=True)
        same = True
        for name, param in model.named_parameters():
            if args.method in ("zero_init", "annot_zero3"):
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    full = param.data.clone()
            else:
                full = param.full_tensor()
            same = same and torch.equal(full.cpu(), reference[name])
            del full
        result["equal_1rank"] = same
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


def launch(method: str, args: argparse.Namespace, out: Path, compare: Path | None, checkpoint: Path | None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
           "--master_port=29731", __file__, "--worker", "--method", method, "--out", str(out),
           "--n_layer", str(args.n_layer), "--n_embd", str(args.n_embd), "--n_head", str(args.n_head),
           "--vocab_size", str(args.vocab_size), "--block_size", str(args.block_size)]
    if compare:
        cmd += ["--compare", str(compare)]
    if checkpoint:
        cmd += ["--checkpoint", str(checkpoint)]
    for flag in ("device", "backend"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", getattr(args, flag)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return [{"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}]
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=24)
    parser.add_argument("--n_embd", type=int, default=2048)
    parser.add_argument("--n_head", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--methods", default="annot,eager,fsdp2,zero_init,load")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: each rank's GPU when there are GPUs, else cpu)")
    parser.add_argument("--backend", default=None,
                        help="process-group backend (default: cpu:gloo,cuda:nccl on GPUs, gloo on cpu)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--compare", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    sys.path.insert(0, str(ROOT))
    import annot
    from examples.gpt.model import GPT

    shape = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                 vocab_size=args.vocab_size, block_size=args.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        torch.manual_seed(0)
        reference = GPT(**shape)  # the 1-rank eager build everyone is compared with
        params = sum(p.numel() for p in reference.parameters())
        largest = max(p.numel() * p.element_size() for p in reference.parameters())
        torch.save(dict(reference.named_parameters()), tmp_path / "reference.pt")
        annot.save(reference, tmp_path / "checkpoint")
        file_bytes = sum(f.stat().st_size for f in (tmp_path / "checkpoint").iterdir())
        del reference
        ideal = params * 4 / args.ranks
        where = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(f"GPT {params / 1e9:.2f}B params fp32 on {args.ranks} {where} ranks: ideal shard "
              f"{ideal / GiB:.2f} GiB, largest parameter {largest / GiB:.2f} GiB, checkpoint {file_bytes / GiB:.2f} GiB")
        print(f"{'method':12} {'peak/rank (GiB)':>20} {'x ideal':>8} {'seconds':>8} {'= 1-rank':>9} {'read/rank (GiB)':>16}")
        for method in args.methods.split(","):
            rows = launch(method, args, tmp_path / f"{method}.json", tmp_path / "reference.pt",
                          tmp_path / "checkpoint" if method == "load" else None)
            if "error" in rows[0]:
                print(f"{method:12} failed: {rows[0]['error'][:100]}")
                continue
            peak = max(r["peak"] for r in rows)
            seconds = max(r["seconds"] for r in rows)
            equal = all(r.get("equal_1rank", False) for r in rows)
            read = max(r.get("bytes_read", 0) for r in rows)
            print(f"{method:12} {peak / GiB:>20.2f} {peak / ideal:>8.2f} {seconds:>8.1f} {str(equal):>9} "
                  f"{(read / GiB if read else float('nan')):>16.2f}")
        os.sync()


if __name__ == "__main__":
    main()
