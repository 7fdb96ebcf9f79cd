"""Training-step throughput of a tiny Qwen3-MoE: annot's FSDP2 against transformers' own
FSDP2, on the same CPU ranks, in one run (issue #29).

    python examples/bench_moe_step.py [--dir DIR] [--ranks 2] [--steps 30] [--batch 4]
                                      [--seq 256] [--experts 8] [--hidden 256] [--layers 4]
                                      [--ep N]

Saves a Qwen3-MoE of random fp32 weights with ``save_pretrained`` into DIR (a temporary
directory unless given; reused when it already holds one), then launches N CPU ranks
(torchrun, gloo). Each rank loads the checkpoint five times:

- ``annot``: ``annot.from_pretrained(DIR, "fsdp2", checkpoint=False)``;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR,
  distributed_config=DistributedConfig(fsdp_size=N))`` (transformers shards it with FSDP2);
- ``transformers, again``: the same a second time: the two transformers copies do the
  same work, so their ratio is the measurement's noise;
- ``annot, checkpointed``: ``annot.from_pretrained(DIR, "fsdp2")``, annot's default,
  which recomputes each decoder layer in backward (activation checkpointing);
- ``transformers, checkpointed``: transformers' FSDP2 copy with
  ``activation_checkpointing_enable()`` (every decoder layer), the same recomputation.

With ``--ep N`` every way splits the experts over groups of N ranks (expert parallelism):
annot with ``mesh=annot.ParallelDims(ep=N)``, transformers with
``DistributedConfig(fsdp_size=ranks, ep_size=N)``; the table then also gives each copy's
resident bytes per rank (its parameters' and AdamW states' local shards, counted).

Each gets AdamW (lr 1e-4) and the same batch (random tokens, one batch per rank), runs
three untimed steps, then all take turns, step by step, in a rotating order, for
``--steps`` rounds. A step is forward, backward and optimizer step; its time is the
slowest rank's. Prints each model's median step time, tokens per second over all ranks
(``batch * seq * ranks`` / median), the ratio to the transformers copy doing the same
work (checkpointed or not), and the first step's loss of each (equal weights and data: the losses must agree). Not a test: numbers depend
on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("annot", "transformers", "transformers, again", "annot, checkpointed", "transformers, checkpointed")
# The transformers copy each way is measured against: the same work.
REFERENCE = {way: "transformers, checkpointed" if "checkpointed" in way else "transformers" for way in WAYS}


def save_checkpoint(directory: Path, args: argparse.Namespace) -> int:
    """A Qwen3-MoE of random weights in ``directory`` (kept if already there); its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=args.hidden // 4,
        num_experts=args.experts, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False)
    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def worker(args: argparse.Namespace) -> None:
    """One rank: load the three copies, time their steps in turns, print rank 0's table."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import annot

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ep = {"ep_size": args.ep} if args.ep > 1 else {}
    mesh = {"mesh": annot.ParallelDims(ep=args.ep)} if args.ep > 1 else {}

    def transformers_fsdp2() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world, **ep))

    models = {
        "annot": annot.from_pretrained(args.dir, "fsdp2", checkpoint=False, **mesh),
        "transformers": transformers_fsdp2(),
        "transformers, again": transformers_fsdp2(),
        "annot, checkpointed": annot.from_pretrained(args.dir, "fsdp2", **mesh),
        "transformers, checkpointed": transformers_fsdp2(),
    }
    models["transformers, checkpointed"].activation_checkpointing_enable()
    for model in models.values():
        model.train()
    optimizers = {way: torch.optim.AdamW(m.parameters(), lr=1e-4) for way, m in models.items()}
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, 1024, (args.batch, args.seq), generator=generator)

    def step(way: str) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        loss = models[way](input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizers[way].step()
        optimizers[way].zero_grad(set_to_none=True)
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds), float(loss.detach())

    first = {way: step(way)[1] for way in WAYS}
    for _ in range(2):
        for way in WAYS:
            step(way)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(args.steps):
        for j in range(len(WAYS)):
            way = WAYS[(i + j) % len(WAYS)]
            times[way].append(step(way)[0])
    resident = {way: _resident_bytes(models[way], optimizers[way]) for way in WAYS}
    if rank == 0:
        median = {way: statistics.median(t) for way, t in times.items()}
        rate = {way: args.batch * args.seq * world / m for way, m in median.items()}
        print(f"{'way':27s} {'median step':>12s} {'fastest-slowest':>16s} {'tokens/s':>9s} "
              f"{'x transformers (same work)':>27s} {'first loss':>11s} {'resident MiB/rank':>18s}")
        for way in WAYS:
            print(f"{way:27s} {median[way]:10.3f} s {min(times[way]):7.3f}-{max(times[way]):.3f} s "
                  f"{rate[way]:9.0f} {rate[way] / rate[REFERENCE[way]]:27.3f} {first[way]:11.6f} "
                  f"{resident[way] / 2**20:18.2f}")
        print(f"noise (transformers, again / transformers): "
              f"{rate['transformers, again'] / rate['transformers']:.3f}")
    dist.destroy_process_group()


def _resident_bytes(model, optimizer) -> int:
    """This rank's bytes of ``model``'s parameters and ``optimizer``'s states: each
    tensor's local shard (a DTensor's ``to_local``), counted, the largest rank's."""
    import torch
    import torch.distributed as dist

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) for p in model.parameters())
    total += sum(local(v) for state in optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor) and v.ndim > 0)
    most = torch.tensor(total, dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="checkpoint directory (made if absent)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (each model once per round)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ep", type=int, default=1,
                        help="split the experts over groups of EP ranks (expert parallelism; default 1: off)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for name in ("ranks", "steps", "batch", "seq", "experts", "layers", "ep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.hidden < 16 or args.hidden % 4:
        parser.error("--hidden must be a multiple of 4, at least 16")
    if args.ranks % args.ep or args.experts % args.ep:
        parser.error("--ep must divide --ranks and --experts")
    with tempfile.TemporaryDirectory(prefix="annot-moe-step-") as tmp:
        directory = args.dir or Path(tmp)
        params = save_checkpoint(directory, args)
        import torch
        import transformers

        print(f"Qwen3-MoE, {params / 1e6:.1f}M parameters ({args.experts} experts, top-2, "
              f"{args.layers} layers, hidden {args.hidden}), fp32, batch {args.batch} x seq {args.seq} "
              f"per rank, {args.ranks} CPU ranks (gloo), expert parallel {args.ep}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}", flush=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                   "--master_port", str(29500 + os.getpid() % 1000), __file__, "--worker",
                   "--dir", str(directory)] + [f"--{n}={getattr(args, n)}" for n in
                                                ("steps", "batch", "seq", "experts", "hidden", "layers", "ep")]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(command, check=True, env=env)


if __name__ == "__main__":
    main()
