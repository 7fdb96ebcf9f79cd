"""The memory planner against counted bytes: 2-rank CPU training runs of the example GPT,
every strategy annot builds, the planner's per-rank prediction beside the measured peak.

    python examples/bench_memory.py            # launches torchrun once, prints the table
    python examples/bench_memory.py --simulate # FSDP2 at world size 8, 1.31B, simulated

``--device cuda|cpu`` and ``--backend BACKEND`` choose where the ranks train (default, as
`annot.init_distributed` picks: each rank's GPU with NCCL where there are GPUs, else the
CPU with gloo); the figures below and in the README are from CPU runs. The simulation
needs neither.

Method: each rank counts live tensor bytes with `annot.memory.counting.LiveBytes` (a
TorchDispatchMode over storages, the method of torch's MemTracker) from before the model
is built (under `annot.meta_init`) through `annot.auto_wrap` and 3 training steps with
torch's AdamW (``foreach=True``, as on GPUs); the peak is taken over the training steps.
The prediction is `annot.memory`'s for the same shape, strategy and config, at world
size 2 in fp32. On a CPU everything is one memory, so offload rows compare the sum of
device and host terms (`RankMemory.combined`); the margin and reserve for what only a GPU
has (CUDA context, caching allocator) are not part of either figure.

Worker mode (what torchrun runs): ``bench_memory.py --worker OUT SPEC_JSON``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import annot  # noqa: E402
from annot.memory.counting import LiveBytes  # noqa: E402
from annot.memory.strategies import strategy  # noqa: E402

#: Two model sizes (GPT shape, micro-batch, sequence) and the rows: strategy key and
#: whether the Plan's checkpointing is on. DeepSpeed's checkpointed rows come first:
#: its checkpointing must be configured before any deepspeed.initialize in a process.
SIZES: dict[str, dict[str, Any]] = {
    "3.5M": dict(shape=dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, block_size=128),
                 batch=4, seq=128),
    "8.8M": dict(shape=dict(n_layer=4, n_embd=384, n_head=6, vocab_size=4096, block_size=256),
                 batch=2, seq=256),
}
SCENARIOS: list[tuple[str, bool]] = [
    ("zero3", True), ("zero2", True), ("zero3-offload", True),
    ("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True), ("fsdp2-no-reshard", False),
    ("fsdp1", False), ("fsdp1", True), ("zero1", False), ("zero2", False), ("zero3", False),
    ("zero2-offload", False), ("zero3-offload-opt", False), ("zero3-offload", False),
    ("fsdp2-offload", False), ("fsdp2-offload", True),
]
WORLD = 2
STEPS = 3


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def measure(key: str, checkpoint: bool, size: dict[str, Any], device: torch.device) -> int:
    """This rank's counted peak of live tensor bytes over the training steps."""
    import torch.distributed as dist

    from examples.gpt.model import GPT

    chosen = strategy(key)
    counter = LiveBytes()
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    batch, seq, vocab = size["batch"], size["seq"], size["shape"]["vocab_size"]
    with counter:
        torch.manual_seed(0)
        with annot.meta_init():
            model = GPT(**size["shape"])
        trainer = annot.auto_wrap(model, chosen.engine, checkpoint=checkpoint, device=device,
                                  optimizer=make_optimizer, **chosen.engine_options("fp32"))
        counter.reset_peak()
        for _ in range(STEPS):
            data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            loss = trainer(data[:, :-1], data[:, 1:])[1]  # the logits are not kept
            trainer.backward(loss)
            trainer.step()
            trainer.zero_grad()
            del data, loss
    del trainer, model
    gc.collect()
    return counter.peak


def worker(out: str, spec_json: str) -> None:
    import torch.distributed as dist

    spec = json.loads(spec_json)
    device = annot.init_distributed(spec["backend"], device=spec["device"])
    results: dict[str, list[int]] = {}
    for name in spec["sizes"]:
        for key, checkpoint in spec["scenarios"]:
            peak = measure(key, checkpoint, SIZES[name], device)
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, peak)
            results[f"{name}|{key}|{int(checkpoint)}"] = every
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown (see tests/distributed.py, worker_main)


def predict(name: str, key: str, checkpoint: bool) -> int:
    """The planner's per-rank figure for one row (device and host terms together)."""
    from annot.memory.activations import trace_step
    from annot.memory.engine_memory import model_facts
    from annot.memory.report import strategy_memory
    from examples.gpt.model import GPT

    size = SIZES[name]
    with torch.device("meta"):
        model = GPT(**size["shape"])
    plan = annot.plan(model)
    trace = trace_step(model, plan, batch=size["batch"], seq=size["seq"], checkpoint=checkpoint)
    memory = strategy_memory(strategy(key), trace, model_facts(model, plan), plan, world=WORLD,
                             precision="fp32", optimizer="adamw")
    return memory.combined


def compare(measured: dict[str, list[int]]) -> list[dict[str, Any]]:
    rows = []
    for label, peaks in measured.items():
        name, key, checkpoint = label.split("|")
        predicted = predict(name, key, checkpoint == "1")
        peak = max(peaks)
        rows.append(dict(size=name, strategy=key, checkpoint=checkpoint == "1", measured=peak,
                         predicted=predicted, error=predicted / peak - 1))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | strategy | checkpointing | measured peak (MiB) | planner (MiB) | error |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {strategy(r['strategy']).label} | {'yes' if r['checkpoint'] else 'no'} "
                     f"| {r['measured'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | {r['error']:+.1%} |")
    return "\n".join(lines)


def launch(out: Path, sizes: list[str], scenarios: list[tuple[str, bool]] = SCENARIOS,
           timeout: float = 900, device: str | None = None,
           backend: str | None = None) -> dict[str, list[int]]:
    """One torchrun launch of every size and row; rank 0's results. ``device`` and
    ``backend``: `annot.init_distributed`'s (``None``: its defaults)."""
    from tests.distributed import torchrun

    spec = json.dumps({"sizes": sizes, "scenarios": scenarios, "device": device,
                       "backend": backend})
    torchrun(__file__, "--worker", str(out), spec, nproc=WORLD, timeout=timeout)
    return torch.load(out)


#: A GPT of 1.31B parameters for the simulation at world size 8.
SIMULATED = dict(shape=dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304, block_size=1024),
                 batch=1, seq=1024)


def simulate_fsdp2(size: dict[str, Any], world: int, checkpoint: bool) -> tuple[int, int]:
    """(torch's FSDPMemTracker peak, the planner's figure) for rank 0 of ``world`` FSDP2
    ranks with every block checkpointed or none (`tracked_fsdp2_peak`)."""
    from annot.memory.activations import trace_step
    from annot.memory.engine_memory import model_facts
    from annot.memory.report import strategy_memory
    from annot.runtime.activation_checkpoint import apply_checkpointing
    from examples.gpt.model import GPT

    with torch.device("meta"):
        meta = GPT(**size["shape"])
    plan = annot.plan(meta)

    def prepare(model: torch.nn.Module) -> None:
        if checkpoint:
            apply_checkpointing(model, plan.paths("checkpoint"))

    measured = tracked_fsdp2_peak(size, world, plan, prepare)
    trace = trace_step(meta, plan, batch=size["batch"], seq=size["seq"], checkpoint=checkpoint)
    planned = strategy_memory(strategy("fsdp2"), trace, model_facts(meta, plan), plan, world=world,
                              precision="fp32", optimizer="adamw")
    return measured, planned.device


def tracked_fsdp2_peak(size: dict[str, Any], world: int, plan: Any,
                       prepare: Callable[[torch.nn.Module], None]) -> int:
    """Torch's FSDPMemTracker peak for rank 0 of ``world`` FSDP2 ranks of the GPT of
    ``size``, simulated in this process: FakeTensorMode (no memory) and torch's fake
    process group; ``prepare`` installs the activation tools (checkpointing) on the
    model, then annot's FSDP2 step shards it by ``plan`` (`apply_fsdp2`, as `auto_wrap`
    does); 2 training steps. AdamW runs with ``foreach=False`` here: over fake DTensors
    the tracker counts foreach AdamW's temporaries many times over (1.3B model: 16.5 GiB
    of "optimizer state" for 1.2 GiB of states it holds afterwards), an artefact of the
    simulation; the peak is in backward either way."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from annot.engines.fsdp2 import apply_fsdp2
    from examples.gpt.model import GPT

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: it reads its ranks
        with FakeTensorMode():
            model = GPT(**size["shape"])
            prepare(model)
            apply_fsdp2(model, plan, offload=False, mixed_precision=None, reshard_after_forward=True,
                        mesh=mesh, device=torch.device("cpu"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            x = torch.randint(0, size["shape"]["vocab_size"], (size["batch"], size["seq"]))
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x, x))
            with tracker:
                for step in range(2):
                    loss = model(x, x)[1]
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    del loss
                    if step == 0:
                        tracker.reset_mod_stats()  # the tracker's rule for a second step
            return int(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])
    finally:
        dist.destroy_process_group()


def main() -> None:
    """``--save PATH`` keeps the measured peaks; ``--from PATH`` predicts against them
    again without launching."""
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
        return
    import tempfile

    if sys.argv[1:2] == ["--simulate"]:
        print("| world | model | checkpointing | FSDPMemTracker peak (GiB) | planner (GiB) | error |")
        print("|---:|---|---|---:|---:|---:|")
        for checkpoint in (False, True):
            measured, planned = simulate_fsdp2(SIMULATED, 8, checkpoint)
            print(f"| 8 | GPT 1.31B | {'yes' if checkpoint else 'no'} | {measured / 2**30:.2f} "
                  f"| {planned / 2**30:.2f} | {planned / measured - 1:+.1%} |")
        return
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=False))
    if "--from" in args:
        measured = torch.load(args["--from"])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            measured = launch(Path(tmp) / "out.pt", list(SIZES), device=args.get("--device"),
                              backend=args.get("--backend"))
        if "--save" in args:
            torch.save(measured, args["--save"])
    print(table(compare(measured)))


if __name__ == "__main__":
    main()
