"""Step time and memory of a Llama under FSDP2: eager, compiled blocks, compiled + float8.

    python examples/bench_speed.py [--device cuda] [--size 1b|tiny] [--steps 20]
                                   [--ways eager,compiled,float8-tensorwise,float8-rowwise]
                                   [--backend inductor] [--batch 2] [--seq 2048]

One process (world 1, FSDP2 over one rank, as torchtitan's single-GPU runs), the model in
bfloat16, each way built fresh from the same seed through
``annot.auto_wrap(model, "fsdp2", checkpoint=True, optimizer=AdamW, compile=..., float8=...)``.
After 3 untimed steps (the compile happens there), ``--steps`` AdamW steps are timed one
by one (synchronized on a GPU): the table gives the median step, tokens per second, the
speedup over eager, the peak memory (``torch.cuda.max_memory_allocated`` on a GPU; on a
CPU the most live tensor bytes of the eager way, `annot.memory.counting.LiveBytes`, and
none for the compiled ways: a counting dispatch mode keeps dynamo from compiling), the
last loss and what compiled (`annot.compiled_blocks.describe`: blocks whole, with graph
breaks or eager, and why).

``--size 1b``: a Llama of 1.1B parameters (hidden 2048, 22 layers, MLP 5632, 32 heads,
4 key/value heads, vocabulary 32000: TinyLlama's shape); ``tiny`` (the default on a CPU):
hidden 256, 2 layers, for a smoke run, where compiled and float8 steps are not faster
(no float8 matmul units, and aot_eager's kernels are eager's). torchtitan's published
ratios on Llama 3.1 8B, 8 H100s: compile 1.16x over eager, compile + float8 1.28x over
compile. Float8 needs torchao; on a GPU, compute capability 8.9 or newer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

WAYS = ("eager", "compiled", "float8-tensorwise", "float8-rowwise")
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default=None,
                        help="1b on a GPU, tiny on a CPU (default)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--backend", default=None, help="compile backend (default: inductor on a GPU, "
                                                        "aot_eager on a CPU)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default: 2048 on a GPU, 128 on a CPU")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.size = args.size or ("1b" if gpu else "tiny")
    args.backend = args.backend or ("inductor" if gpu else "aot_eager")
    args.seq = args.seq or (2048 if gpu else 128)
    args.ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose from {', '.join(WAYS)}")
    return args


def build(size: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    import annot

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False,
                         torch_dtype=torch.bfloat16)
    with annot.meta_init():
        return LlamaForCausalLM(config).to(torch.bfloat16)


def run_way(way: str, args: argparse.Namespace) -> dict[str, float | str]:
    import annot
    from annot.compiled_blocks import compile_report, describe
    from annot.memory.counting import LiveBytes

    gpu = args.device.startswith("cuda")
    # On a CPU nothing counts memory while a way compiles: a counting dispatch mode keeps
    # dynamo from tracing at all ("non-infra torch dispatch mode present").
    counter = LiveBytes() if way == "eager" and not gpu else None
    options = {"compile": args.backend if way != "eager" else None,
               "float8": way.removeprefix("float8-") if way.startswith("float8") else None}
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    with counter if counter is not None else contextlib.nullcontext():
        model = build(args.size)
        trainer = annot.auto_wrap(model, "fsdp2", checkpoint=True, device=args.device,
                                  optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4), **options)
        vocab = SIZES[args.size]["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        times, loss = [], float("nan")
        for step in range(3 + args.steps):
            tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
            start = time.perf_counter()
            out = trainer(input_ids=tokens, labels=tokens)
            trainer.backward(out.loss)
            trainer.step()
            trainer.zero_grad()
            if gpu:
                torch.cuda.synchronize()
            if step >= 3:
                times.append(time.perf_counter() - start)
            loss = out.loss.item()
            del out
        del trainer
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if gpu else counter.peak if counter is not None else float("nan")
    report = describe(compile_report(model)) if way != "eager" else ""
    return {"way": way, "step_s": step_s, "tokens_s": args.batch * args.seq / step_s, "peak": peak, "loss": loss,
            "compiled": report}


def main(argv: list[str] | None = None) -> list[dict[str, float | str]]:
    args = parse_args(argv)
    import annot

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    annot.init_distributed(device=args.device)
    rows = [run_way(way, args) for way in args.ways]
    eager = next((r["step_s"] for r in rows if r["way"] == "eager"), None)
    print(f"Llama {args.size}, {args.device}, FSDP2 world 1, bf16, checkpointed, batch {args.batch} x "
          f"{args.seq} tokens, compile backend {args.backend}, median of {args.steps} steps")
    print(f"{'way':<20}{'step (s)':>10}{'tokens/s':>12}{'vs eager':>10}{'peak (MiB)':>12}{'loss':>10}")
    for r in rows:
        ratio = f"{eager / r['step_s']:.2f}x" if eager else "-"
        print(f"{r['way']:<20}{r['step_s']:>10.3f}{r['tokens_s']:>12.0f}{ratio:>10}"
              f"{r['peak'] / 2**20:>12.1f}{r['loss']:>10.4f}  {r['compiled']}")
    torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
