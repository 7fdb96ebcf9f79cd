"""Train the example GPT for a few steps on N processes, sharded by annot.

    torchrun --nproc_per_node 2 examples/gpt/train.py [--steps 20] [--engine fsdp2|fsdp1|ddp|deepspeed]
                                                      [--resume DIR --save-every N]

The model is built under annot.meta_init (no memory) and materialized by auto_wrap.
Rank 0 prints the Plan, then the loss of every step (averaged over ranks). The data is a
fixed synthetic set of counting sequences (each token is the previous one plus a
per-sequence stride), so the loss falls within a few steps. Runs on GPUs (NCCL; each rank
on GPU ``LOCAL_RANK % GPUs``) or on CPU (gloo), as `annot.init_distributed` picks, or as
``--device cuda|cpu`` says (more ranks than GPUs: CPU unless ``--device cuda``, then the
ranks share GPUs over gloo); run without torchrun it trains in one process.

With ``--resume DIR`` it continues from the newest complete training state in DIR (model,
optimizer, step, RNG; any world size or engine), if there is one, and with
``--save-every N`` saves one there every N steps (`annot.save_state`, the last two kept).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the checkout's `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import annot  # noqa: E402
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: this rank's GPU when there is one, else cpu)")
    parser.add_argument("--resume", metavar="DIR", default=None,
                        help="continue from the newest training state in DIR, and save there")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="with --resume: save the training state every N steps")
    return parser.parse_args(argv)


def counting_data(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences of ``length + 1`` tokens: start + stride * position, modulo vocab."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + stride * torch.arange(length + 1)) % vocab


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
        if rank == 0:
            print(annot.plan(model), flush=True)

        # The optimizer is a factory: every engine builds it after sharding (which replaces
        # the parameters), and gives back the same backward / step / zero_grad.
        trainer = annot.auto_wrap(
            model, args.engine, checkpoint=args.checkpoint, device=device,
            optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
            **({"offload": True} if args.offload else {}))

        data = counting_data(args.steps * world * args.batch_size, args.block_size,
                             args.vocab_size, args.seed + 1)
        first_step = 0
        if args.resume and annot.latest_state(args.resume) is not None:
            # The data is indexed by step, so the step is also the position in the data.
            first_step = annot.load_state(args.resume, trainer).step
            if rank == 0:
                print(f"resumed from {annot.latest_state(args.resume)} at step {first_step}",
                      flush=True)
        losses = []
        start = time.perf_counter()
        for step in range(first_step, args.steps):
            first = (step * world + rank) * args.batch_size  # this rank's rows of this step
            batch = data[first : first + args.batch_size].to(device)
            _, loss = trainer(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            trainer.backward(loss)
            trainer.step()
            trainer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0:
                print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
            if args.resume and args.save_every and (step + 1) % args.save_every == 0:
                annot.save_state(args.resume, trainer, step=step + 1, keep_last=2)
        if rank == 0 and losses:
            print(f"{args.engine} on {world} process(es): loss {losses[0]:.4f} -> "
                  f"{losses[-1]:.4f} in {len(losses)} steps, {time.perf_counter() - start:.1f} s")
        dist.barrier()  # no rank tears gloo down while another is still in a collective
        return losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
