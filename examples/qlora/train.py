"""QLoRA with annot: a frozen base quantized to NF4 on load, LoRA adapters, FSDP2.

    torchrun --nproc_per_node 2 examples/qlora/train.py [--steps 4] [--model DIR] [--checkpoint]

One call loads the model: ``annot.from_pretrained(DIR, "fsdp2", peft_config=LoraConfig(...),
quantize="nf4")`` builds it on the meta device with the adapters, reads each frozen linear
weight whole, quantizes it to 4-bit NormalFloat (torchao), lets FSDP2 split it over the
ranks, and reads the rest of the checkpoint shard by shard. Without ``--model`` it trains a
tiny Llama built from a config (seed 0) and saved to a temporary folder.

The data is the same global batch whatever the number of ranks: step s draws
``--batch`` counting sequences from (seed, s) alone, and rank r of N trains on the r-th N-th of
them, so ``--nproc_per_node 1`` and ``2`` print the same ``step N  loss X`` lines (the
loss is the mean over the global batch; every sequence has as many tokens). Rank 0
prints what was quantized and what was not, then each step's loss. Runs on the CPU
(gloo) or on GPUs, as `annot.init_distributed` picks; without torchrun, in one process.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the checkout's `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import annot  # noqa: E402

#: The projections LoRA adapts (Llama's names; every linear of a block).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a transformers model folder (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, all ranks together")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--rank", type=int, default=8, dest="lora_rank", help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: a GPU when there is one")
    return parser.parse_args(argv)


def tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama whose every block linear splits into whole NF4 scale blocks on
    2 ranks (hidden 256, MLP 512, 2 key/value heads), saved in ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def batch(step: int, args: argparse.Namespace, vocab: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of step ``step``'s global batch (drawn from the seed and the
    step alone)."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    # Counting sequences (each token the previous plus the sequence's stride): learnable,
    # so the loss falls within a few steps.
    start = torch.randint(0, vocab, (args.batch, 1), generator=generator)
    stride = torch.randint(1, 4, (args.batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(args.seq)) % vocab
    per_rank = args.batch // world
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    from peft import LoraConfig  # after the arguments: --help answers without PEFT's import (6 s)

    device = annot.init_distributed(device=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} ranks")
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    losses: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.model
            if folder is None:  # rank 0 writes the tiny model, every rank reads its folder
                shared = [str(tiny_llama(Path(scratch) / "tiny-llama")) if rank == 0 else None]
                dist.broadcast_object_list(shared, src=0)
                folder = Path(str(shared[0]))
            started = time.perf_counter()
            torch.manual_seed(args.seed)  # the same adapter initialization on every rank
            model = annot.from_pretrained(
                folder, "fsdp2", peft_config=LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                        target_modules=TARGETS),
                quantize="nf4", checkpoint=args.checkpoint, device=device)
            if rank == 0:
                print(f"loaded and quantized in {time.perf_counter() - started:.1f} s", flush=True)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
            vocab = model.get_input_embeddings().num_embeddings
            for step in range(args.steps):
                tokens = batch(step, args, vocab, rank, world).to(device)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world)
                if rank == 0:
                    print(f"step {step}  loss {losses[-1]:.7f}", flush=True)
            dist.barrier()  # no rank removes the folder while another still reads it
    finally:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
