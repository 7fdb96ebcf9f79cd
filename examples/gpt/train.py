"""Train the example GPT for a few steps on N processes, sharded by annot.

    torchrun --nproc_per_node 2 examples/gpt/train.py [--steps 20] [--engine fsdp2|fsdp1|ddp|deepspeed]
                                                      [--resume DIR --save-every N] [--cp N [--cp-attention ulysses]]
                                                      [--float8 tensorwise|rowwise|rowwise_with_gw_hp] [--compile [BACKEND]]

The model is built under annot.meta_init (no memory) and materialized by auto_wrap.
Rank 0 prints the Plan, then the loss of every step (averaged over ranks). The data is an
endless synthetic stream of counting sequences (each token is the previous one plus a
per-sequence stride; sequence i is drawn from (seed, i) alone), read by
annot.ResumableLoader: each step takes the next N x batch_size sequences of the stream,
rank r the r-th block, so the loss falls within a few steps and the data does not depend
on --steps. Runs on GPUs (NCCL; each rank on GPU ``LOCAL_RANK % GPUs``) or on CPU (gloo),
as `annot.init_distributed` picks, or as ``--device cuda|cpu`` says (more ranks than
GPUs: CPU unless ``--device cuda``, then the ranks share GPUs over gloo); run without
torchrun it trains in one process.

With ``--cp N`` (FSDP2 or DeepSpeed) each sequence is split over N ranks (context parallelism,
``annot.ParallelDims(cp=N)``): the N ranks of a group read the same sequences, each
computes on its part, and the loss is the whole sequences'; ``--nproc_per_node N --cp N``
prints the losses of one process.

With ``--resume DIR`` the loop runs inside `annot.Interruptions`: it continues from the
newest training state in DIR that loads (model, optimizer, step, RNG and the position in
the data stream; any world size or engine; a damaged newer one is named and passed
over), if there is one; with ``--save-every N`` it saves one there every N steps
(`annot.save_state`, the last two kept; ``--async-save [thread|process]`` writes them in
the background);
on SIGTERM or SIGUSR1 every rank saves at the next step and exits 0; a collective that
hangs past ``--collective-timeout`` seconds is named and ends the process with status 1.
So ``torchrun --max-restarts N`` and a scheduler's requeue need nothing else. Resumed
with as many ranks, it prints the losses the uninterrupted run printed; on another
number of ranks it continues from the same sequence of the stream (keep N x batch_size
to see the same sequences per step). What each save cost is logged.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the checkout's `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import annot  # noqa: E402
from annot.interruptions import DEFAULT_COLLECTIVE_TIMEOUT_S  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engine", default="fsdp2", help="fsdp2, fsdp1, ddp or deepspeed")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=None,
                        help="checkpoint every block / none (default: as the Plan says)")
    parser.add_argument("--offload", action="store_true", help="FSDP2: parameters on CPU")
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallel: split each sequence over N ranks (fsdp2, deepspeed)")
    parser.add_argument("--cp-attention", choices=("allgather", "ulysses"), default="allgather",
                        help="with --cp: gather keys and values, or Ulysses' all-to-all over heads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: this rank's GPU when there is one, else cpu)")
    parser.add_argument("--resume", metavar="DIR", default=None,
                        help="continue from the newest training state in DIR, and save there")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="with --resume: save the training state every N steps")
    parser.add_argument("--async-save", nargs="?", const="thread", choices=("thread", "process"),
                        help="with --save-every: write the saves in the background, from a thread "
                             "(the default) or from torch's checkpoint process")
    parser.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        metavar="S", help="with --resume: bound on a collective after the first step")
    parser.add_argument("--float8", metavar="RECIPE", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                        help="the blocks' linears compute in float8 with this torchao recipe (needs torchao)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="compile each block (FSDP2, DDP): inductor, or BACKEND (aot_eager on a "
                             "machine without a C++ compiler)")
    parser.add_argument("--digest", action="store_true",
                        help="print each loss to the last bit and, at the end, a digest of the weights")
    return parser.parse_args(argv)


class CountingSequences(torch.utils.data.Dataset[torch.Tensor]):
    """An endless stream: item ``i`` is ``length + 1`` tokens, start + stride * position
    modulo ``vocab``, with start and stride (1-3) drawn from a hash of ``(seed, i)``, so
    any item is computed on its own and the stream has no end (no ``__len__``)."""

    def __init__(self, length: int, vocab: int, seed: int) -> None:
        self.length, self.vocab, self.seed = length, vocab, seed

    def __getitem__(self, index: int) -> torch.Tensor:
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        start, stride = value % self.vocab, 1 + (value // self.vocab) % 3
        return (start + stride * torch.arange(self.length + 1)) % self.vocab


def train_step(trainer: annot.Trainable, batches: Iterator[torch.Tensor], device: torch.device,
               world: int) -> float:
    """One step on the next batch; the loss averaged over the ranks."""
    batch = next(batches).to(device)
    _, loss = trainer(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    trainer.backward(loss)
    trainer.step()
    trainer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def report(step: int, loss: float, rank: int, exact: bool) -> None:
    if rank == 0:
        print(f"step {step:3d}  loss {loss!r}" if exact else f"step {step:3d}  loss {loss:.6f}", flush=True)


def weights_digest(trainer: annot.Trainable) -> str:
    """A digest of every weight, whole (sharded ones gathered: collective)."""
    digest = hashlib.sha256()
    for name, param in sorted(trainer.model.named_parameters()):
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29511")):
        os.environ.setdefault(key, value)  # without torchrun: one process
    device = annot.init_distributed(device=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        # Built with no memory; auto_wrap materializes it shard by shard, with the values
        # plain construction would give.
        with annot.meta_init():
            model = GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        block_size=args.block_size, vocab_size=args.vocab_size)
        speed = {"float8": args.float8, "compile": args.compile}
        if rank == 0:
            print(annot.plan(model, float8=args.float8, compile=args.compile is not None or None), flush=True)

        # The optimizer is a factory: every engine builds it after sharding (which replaces
        # the parameters), and gives back the same backward / step / zero_grad.
        trainer = annot.auto_wrap(
            model, args.engine, checkpoint=args.checkpoint, device=device, **speed,
            optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
            **({"offload": True} if args.offload else {}),
            **({"mesh": annot.ParallelDims(cp=args.cp), "cp_attention": args.cp_attention}
               if args.cp > 1 else {}))

        # Its position (sequences consumed by all ranks) is saved with the training state.
        # The cp ranks of a group (consecutive ranks: cp is inside shard) read the same rows.
        data = annot.ResumableLoader(
            CountingSequences(args.block_size, args.vocab_size, args.seed + 1),
            batch_size=args.batch_size, rank=rank // args.cp, world_size=world // args.cp)
        losses: list[float] = []
        start = time.perf_counter()
        if args.resume:
            logging.basicConfig(format="%(message)s")  # annot's resumes and save costs, said
            logging.getLogger("annot").setLevel(logging.INFO)
            with annot.Interruptions(args.resume, trainer, data=data,
                                     collective_timeout=args.collective_timeout) as run:
                first_step = run.resume()
                if rank == 0 and first_step:
                    print(f"resumed at step {first_step}, sequence {data.position} of the data", flush=True)
                batches = iter(data)  # from the position the resume put back
                for step in range(first_step, args.steps):
                    losses.append(train_step(trainer, batches, device, world))
                    report(step, losses[-1], rank, args.digest)
                    run.step_done(step + 1)  # on SIGTERM/SIGUSR1: saves step + 1, exits 0
                    if args.save_every and (step + 1) % args.save_every == 0:
                        annot.save_state(args.resume, trainer, step=step + 1, data=data, keep_last=2,
                                         async_save=args.async_save or False)
        else:
            batches = iter(data)
            for step in range(args.steps):
                losses.append(train_step(trainer, batches, device, world))
                report(step, losses[-1], rank, args.digest)
        if args.digest:
            digest = weights_digest(trainer)
            if rank == 0:
                print(f"weights {digest}", flush=True)
        if rank == 0 and losses:
            print(f"{args.engine} on {world} process(es): loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f} in {len(losses)} steps, {time.perf_counter() - start:.1f} s")
        dist.barrier()  # no rank tears gloo down while another is still in a collective
        return losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
