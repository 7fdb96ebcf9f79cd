"""QLoRA on FSDP2: annot's one call against torchao's NF4 wired by hand, and against LoRA
on the unquantized base.

    python examples/bench_qlora.py [--dir DIR] [--ranks 2] [--steps 3] [--dtype bfloat16]
                                   [--ways annot,hand,full]

Each way is one torchrun launch of ``--ranks`` CPU ranks (gloo), the model in ``--dtype``
with LoRA (r=8) on every block linear, imports done before the clock:

- ``annot``: ``annot.from_pretrained(DIR, "fsdp2", peft_config=..., quantize="nf4",
  torch_dtype=DTYPE)``: each frozen block linear read whole and quantized to NF4
  unit by unit as FSDP2 shards the model, everything else read shard by shard; with
  ``checkpoint=False``, as the hand-wired way checkpoints nothing;
- ``hand``: what a user wires with torchao and torch: transformers' ``from_pretrained`` in
  DTYPE on every rank, ``peft.get_peft_model``, ``torchao.quantization.to_nf4`` of the same
  frozen linears (the choice `annot.quantization.choose_linears` makes), then
  ``fully_shard`` on every decoder layer and the root;
- ``full``: ``annot.from_pretrained(DIR, "fsdp2", peft_config=..., torch_dtype=DTYPE)``,
  no quantization.

Per rank: the load's time, its peak resident memory above the process's footprint before
the load (``ru_maxrss`` less ``VmRSS`` at the start), the bytes the rank keeps (an NF4
weight's packed bytes and scales; every other tensor's own), the largest checkpoint tensor
in DTYPE, and their ratio; then the median time of ``--steps`` AdamW steps after one
untimed step (one sequence of 64 tokens per rank). Without ``--dir`` it saves a Llama of
TinyLlama's width with 2 layers (0.22B parameters, 0.41 GiB in bf16) into a temporary
folder. On a CPU, bfloat16 steps are slow (torch's CPU build multiplies bfloat16 matrices
in a generic loop here, about a minute a step); ``--dtype float32`` steps in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WAYS = ("annot", "hand", "full")
LABELS = {"annot": "annot.from_pretrained(..., quantize='nf4')",
          "hand": "torchao to_nf4 + fully_shard, by hand",
          "full": "annot.from_pretrained(...), LoRA, not quantized"}


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _kept_bytes(model) -> int:
    """The bytes this rank keeps: an NF4 weight's packed bytes and scales, every other
    tensor's own (a DTensor's local part)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = getattr(tensor, "_local_tensor", tensor)
        if hasattr(local, "quantized_data"):
            total += sum(getattr(local, inner).nbytes
                         for inner in ("quantized_data", "quantized_scalers", "quantization_factor"))
        else:
            total += local.nbytes
    return total


def _largest(directory: str, itemsize: int) -> int:
    from safetensors import safe_open

    largest = 0
    for file in Path(directory).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                numel = 1
                for size in handle.get_slice(key).get_shape():
                    numel *= size
                largest = max(largest, itemsize * numel)
    return largest


def _hand_wired(directory: str, dtype):
    import peft
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torchao.quantization import to_nf4

    from annot.quantization import choose_linears

    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=TARGETS))
    import torch.distributed as dist

    for name in choose_linears(model, dist.get_world_size()).quantized:
        path, _, attribute = name.rpartition(".")
        owner = model.get_submodule(path)
        weight = getattr(owner, attribute)
        setattr(owner, attribute, torch.nn.Parameter(to_nf4(weight.detach(), 64, 256), requires_grad=False))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def worker(way: str, directory: str, steps: int, dtype_name: str) -> None:
    import importlib

    import peft
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401

    import annot

    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for module in ("torchao.quantization", "annot.huggingface.pretrained", "annot.wrap",
                   "annot.engines.fsdp2", "annot.quantization", "torch.distributed.tensor",
                   "transformers.models.llama.modeling_llama"):
        importlib.import_module(module)
    dist.barrier()
    start_rss, started = _rss(), time.perf_counter()
    if way == "hand":
        model = _hand_wired(directory, dtype)
    else:
        # checkpoint=False: the hand-wired way checkpoints nothing, and the steps compared
        # must do the same arithmetic (annot's default recomputes each block's forward).
        model = annot.from_pretrained(directory, "fsdp2", torch_dtype=dtype, checkpoint=False,
                                      peft_config=peft.LoraConfig(r=8, target_modules=TARGETS),
                                      quantize="nf4" if way == "annot" else None)
    dist.barrier()
    load_seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    vocab = model.get_input_embeddings().num_embeddings
    times = []
    for step in range(steps + 1):
        tokens = torch.randint(0, vocab, (1, 64), generator=generator)
        dist.barrier()
        began = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        if step:  # the first step allocates the optimizer's state
            times.append(time.perf_counter() - began)
    row = {"rank": rank, "load": load_seconds, "above": peak - start_rss, "kept": _kept_bytes(model),
           "largest": _largest(directory, dtype.itemsize), "step": statistics.median(times)}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def save_model(directory: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def launch(way: str, directory: Path, ranks: int, steps: int, dtype: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           __file__, "--worker", way, "--dir", str(directory), "--steps", str(steps), "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{way} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="a transformers Llama folder (default: one saved here)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the model's dtype (the checkpoint is saved in bfloat16)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, str(args.dir), args.steps, args.dtype)
        return
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}; choose among {', '.join(WAYS)}")
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir
        if directory is None:
            directory = Path(scratch) / "llama"
            save_model(directory)
        results = {way: launch(way, directory, args.ranks, args.steps, args.dtype) for way in ways}
    print(f"{args.ranks} CPU ranks, {args.dtype}, {directory}; per rank (the slower rank's figures):")
    print(f"{'way':45s} {'load':>7s} {'above start':>12s} {'kept':>9s} {'largest':>9s} "
          f"{'above / (kept + largest)':>25s} {'step':>8s}")
    for way, rows in results.items():
        r = max(rows, key=lambda row: row["above"])
        gib = 2**30
        print(f"{LABELS[way]:45s} {r['load']:6.1f}s {r['above'] / gib:9.3f} GiB {r['kept'] / gib:5.3f} GiB "
              f"{r['largest'] / gib:5.3f} GiB {r['above'] / (r['kept'] + r['largest']):25.2f} "
              f"{max(row['step'] for row in rows):7.2f}s")
    if "annot" in results and "hand" in results:
        ratio = max(r["step"] for r in results["annot"]) / max(r["step"] for r in results["hand"])
        print(f"annot's step over the hand-wired one: {ratio:.3f}")


if __name__ == "__main__":
    main()
