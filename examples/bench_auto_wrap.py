"""What one `annot.auto_wrap` call costs beyond the engine's own work.

    python examples/bench_auto_wrap.py [--repeats 20] [--layers 12] [--device cuda|cpu]
                                       [--backend BACKEND]

In one process (a 1-rank group: gloo on the CPU, NCCL on a GPU, as `annot.init_distributed`
picks unless ``--device``/``--backend`` say) with transformers and deepspeed imported (a typical
training process: their modules add hundreds of thousands of objects to the heap), it
times, per engine, the median of ``--repeats`` calls of

- ``auto_wrap``: the whole call (plan, checks, checkpointing, the engine's wrap);
- ``engine only``: the engine's own wrap with the same Plan (``fully_shard`` per unit and
  the root; ``FullyShardedDataParallel`` with the Plan's wrap policy; ``DistributedDataParallel``);
- ``overhead``: the difference: what annot adds;
- ``gc scan``: one walk over the garbage collector's objects looking for optimizers,
  which the optimizer-order check used to do on every call (for comparison).

Timings, not assertions: compare them loosely on a busy machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import annot  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402


def model(layers: int) -> torch.nn.Module:
    return GPT(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, block_size=32)


def engine_only(engine: str, layers: int, device: torch.device) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    m = model(layers)
    plan = annot.plan(m)
    start = time.perf_counter()
    if engine == "fsdp2":
        mesh = init_device_mesh(device.type, (1,))
        for unit in plan.units:
            fully_shard(m.get_submodule(unit.path), mesh=mesh)
        fully_shard(m, mesh=mesh)
    elif engine == "fsdp1":
        policy, _ = annot.fsdp1_policies(m, plan)
        FullyShardedDataParallel(m, auto_wrap_policy=policy, use_orig_params=True,
                                 device_id=device)
    else:
        DistributedDataParallel(m.to(device), device_ids=[device] if device.type == "cuda" else None)
    return time.perf_counter() - start


def whole(engine: str, layers: int, device: torch.device) -> float:
    m = model(layers)
    start = time.perf_counter()
    annot.auto_wrap(m, engine, device=device)
    return time.perf_counter() - start


def gc_scan() -> float:
    start = time.perf_counter()
    gc.collect()
    found = sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.optim.Optimizer))
    del found
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: the GPU when there is one, else cpu)")
    parser.add_argument("--backend", default=None,
                        help="process-group backend (default: cpu:gloo,cuda:nccl on a GPU, gloo on cpu)")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK="0", WORLD_SIZE="1")
    import deepspeed  # noqa: F401  (the heap a training process has)
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    device = annot.init_distributed(args.backend, device=args.device)
    try:
        print(f"GPT with {args.layers} blocks on {device} ({dist.get_backend()}); median of {args.repeats} calls; "
              f"{len(gc.get_objects()):,} objects tracked by the garbage collector")
        print("| engine | auto_wrap (ms) | engine only (ms) | overhead (ms) | gc scan (ms) |")
        print("|---|---:|---:|---:|---:|")
        for engine in ("fsdp2", "fsdp1", "ddp"):
            for _ in range(2):  # warm up imports and caches
                whole(engine, args.layers, device), engine_only(engine, args.layers, device)
            total = statistics.median(whole(engine, args.layers, device) for _ in range(args.repeats))
            bare = statistics.median(engine_only(engine, args.layers, device)
                                     for _ in range(args.repeats))
            scan = statistics.median(gc_scan() for _ in range(3))
            print(f"| {engine} | {total * 1e3:.1f} | {bare * 1e3:.1f} | {(total - bare) * 1e3:.1f} "
                  f"| {scan * 1e3:.0f} |", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
