"""Train the example GPT with one strategy and print step time, tokens/s and peak memory.

In the spirit of the DeepSpeed/Lightning minGPT benchmark. One run (launched by torchrun;
the DeepSpeed launcher works too):

    torchrun --nproc_per_node 2 examples/benchmark.py --strategy fsdp2 --checkpoint \\
        --n_layer 8 --n_head 8 --n_embd 512 --batch_size 8 --steps 10

The table over every strategy (this script launches torchrun once per row, each with a
timeout, and prints a Markdown table):

    python examples/benchmark.py --table --nproc 2 --variants plain,checkpoint,offload \\
        --n_layer 4 --n_head 4 --n_embd 256 --block_size 128 --batch_size 4 --steps 5

Strategies: ``ddp``, ``fsdp2``, ``fsdp1``, ``zero2``, ``zero3`` (DeepSpeed ZeRO stage 2
or 3). ``--checkpoint`` checkpoints every block. ``--offload`` offloads what the strategy
can: parameters and optimizer state for FSDP and ZeRO (``zero2``: optimizer state only),
activations for DDP (`annot.runtime.activation_offload`). ``--precision`` ``fp32``, ``bf16`` or
``fp16`` (every engine's ``mixed_precision``: FSDP/ZeRO cast compute, DDP autocasts its
forward; fp16 scales the loss in the `Trainable`).

``--device`` (``cuda`` or ``cpu``) and ``--backend`` (a process-group backend) default to
this rank's GPU with ``cpu:gloo,cuda:nccl`` where there is one, else the CPU with gloo
(`annot.init_distributed`); the table passes them to every row.

Step time is the mean over the steps after ``--warmup``; tokens/s counts every rank's
tokens; peak memory is the largest over ranks: resident set size on CPU
(``resource.getrusage``, which includes the interpreter and libraries),
``torch.cuda.max_memory_allocated`` on GPUs. Timings are for comparing strategies on one
machine, never for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the checkout's `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import annot  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

STRATEGIES = ("ddp", "fsdp2", "fsdp1", "zero2", "zero3")
VARIANTS = {"plain": [], "checkpoint": ["--checkpoint"], "offload": ["--offload"],
            "checkpoint+offload": ["--checkpoint", "--offload"]}
RESULT_TAG = "BENCHMARK-RESULT "  # rank 0's line the table driver reads
RUN_TIMEOUT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="fsdp2")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--checkpoint", action="store_true", help="checkpoint every block")
    parser.add_argument("--offload", action="store_true",
                        help="FSDP/ZeRO: parameters and optimizer state; DDP: activations")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: this rank's GPU when there is one, else cpu)")
    parser.add_argument("--backend", default=None,
                        help="process-group backend (default: cpu:gloo,cuda:nccl on GPUs, "
                             "gloo on cpu)")
    parser.add_argument("--table", action="store_true",
                        help="launch torchrun for every strategy and variant, print a table")
    parser.add_argument("--nproc", type=int, default=2, help="--table: processes per run")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="--table: which")
    parser.add_argument("--variants", default="plain,checkpoint",
                        help=f"--table: comma-separated, of {', '.join(VARIANTS)}")
    return parser.parse_args(argv)


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> annot.Trainable:
    """The model wrapped for the strategy, with its optimizer."""
    precision = None if args.precision == "fp32" else args.precision
    options: dict[str, object] = {}
    if args.strategy in ("zero2", "zero3"):
        engine = "deepspeed"
        options = dict(stage=3 if args.strategy == "zero3" else 2,
                       offload="cpu" if args.offload else None, mixed_precision=precision)
    elif args.strategy == "ddp":
        # DDP cannot offload parameters; its mixed precision is autocast in the forward.
        engine, options = "ddp", dict(offload_activations=args.offload, mixed_precision=precision)
    else:
        engine = args.strategy
        options = dict(offload=True if args.offload else None, mixed_precision=precision)
    return annot.auto_wrap(model, engine, checkpoint=args.checkpoint, device=args.device,
                           optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4), **options)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run(args: argparse.Namespace) -> dict:
    # This rank's GPU (LOCAL_RANK % GPUs, made current) with NCCL, or the CPU with gloo.
    device = annot.init_distributed(args.backend, device=args.device)
    args.device = str(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        with annot.meta_init():  # auto_wrap materializes it
            model = GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        block_size=args.block_size, vocab_size=args.vocab_size)
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        trainer = wrap(model, args)
        gen = torch.Generator().manual_seed(rank)
        data = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1), generator=gen)
        idx, targets = data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)

        times, loss = [], None
        for i in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            _, loss = trainer(idx, targets)
            trainer.backward(loss)
            trainer.step()
            trainer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)

        # On the compute device: an NCCL-only group cannot reduce a CPU tensor.
        stats = torch.tensor([sum(times) / len(times), peak_memory_bytes(device), loss.item()],
                             dtype=torch.float64, device=device)
        maxima = stats.clone()
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak
        dist.all_reduce(stats)
        step_s = maxima[0].item()
        return {
            "strategy": args.strategy, "checkpoint": args.checkpoint, "offload": args.offload,
            "precision": args.precision, "world": world, "params": params,
            "step_s": step_s, "tokens_per_s": world * args.batch_size * args.block_size / step_s,
            "peak_mem_bytes": int(maxima[1].item()), "loss": stats[2].item() / world,
            "device": device.type,
        }
    finally:
        dist.destroy_process_group()


def launch(args: argparse.Namespace, strategy: str, variant: str) -> dict | str:
    """One torchrun run for a table row: its result, or the reason it failed."""
    passthrough = ["--n_layer", "--n_head", "--n_embd", "--block_size", "--vocab_size",
                   "--batch_size", "--steps", "--warmup", "--precision", "--device", "--backend"]
    sizes = [str(x) for flag in passthrough if getattr(args, flag[2:]) is not None
             for x in (flag, getattr(args, flag[2:]))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",  # a free port
           f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()),
           "--strategy", strategy, *sizes, *VARIANTS[variant]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {RUN_TIMEOUT_S}s"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    # A rank's own exception line ("[rank0]: SomeError: why"); torchrun's summary after it
    # says less.
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [ln for ln in lines if ln.startswith("[rank") and "Error: " in ln] or [
        ln for ln in lines if "Error" in ln]
    return f"failed (exit {proc.returncode}): {errors[0].strip() if errors else 'no result line'}"


def table(args: argparse.Namespace) -> str:
    rows = ["| strategy | variant | step (s) | tokens/s | peak memory (MiB) | final loss |",
            "|---|---|---:|---:|---:|---:|"]
    first: dict | None = None
    for strategy in args.strategies.split(","):
        for variant in args.variants.split(","):
            result = launch(args, strategy, variant)
            if isinstance(result, str):
                rows.append(f"| {strategy} | {variant} | {result} | | | |")
                continue
            first = first or result
            rows.append(f"| {strategy} | {variant} | {result['step_s']:.3f} | "
                        f"{result['tokens_per_s']:,.0f} | {result['peak_mem_bytes'] / 2**20:,.0f} | "
                        f"{result['loss']:.4f} |")
            print(rows[-1], file=sys.stderr, flush=True)  # progress while the table grows
    if first is not None:
        rows.insert(0, f"GPT {first['params'] / 1e6:.1f}M parameters, {args.nproc} processes on "
                       f"{first['device']}, {args.precision}, batch {args.batch_size} x "
                       f"{args.block_size} tokens per rank, {args.steps} timed steps\n")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(table(args), flush=True)
        return
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{result['strategy']}: {result['step_s']:.3f} s/step, "
              f"{result['tokens_per_s']:,.0f} tokens/s, peak {result['peak_mem_bytes'] / 2**20:,.0f} MiB, "
              f"loss {result['loss']:.4f}")
        print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
