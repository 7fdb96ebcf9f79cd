"""The memory planner against counted bytes: 2-rank CPU training runs of the example GPT,
every strategy annot builds, the planner's per-rank prediction beside the measured peak.

    python examples/bench_memory.py            # launches torchrun once, prints the table

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


def measure(key: str, checkpoint: bool, size: dict[str, Any]) -> int:
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
        trainer = annot.auto_wrap(model, chosen.engine, checkpoint=checkpoint,
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
    dist.init_process_group("gloo")
    results: dict[str, list[int]] = {}
    for name in spec["sizes"]:
        for key, checkpoint in spec["scenarios"]:
            peak = measure(key, checkpoint, SIZES[name])
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
    traces = {(None, None, checkpoint): trace_step(model, plan, batch=size["batch"], seq=size["seq"],
                                                   checkpoint=checkpoint)}
    memory = strategy_memory(strategy(key), traces, model_facts(model, plan), plan, world=WORLD,
                             precision="fp32", optimizer="adamw", checkpoint=checkpoint)
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
           timeout: float = 900) -> dict[str, list[int]]:
    """One torchrun launch of every size and row; rank 0's results."""
    from tests.distributed import torchrun

    spec = json.dumps({"sizes": sizes, "scenarios": scenarios})
    torchrun(__file__, "--worker", str(out), spec, nproc=WORLD, timeout=timeout)
    return torch.load(out)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        measured = launch(Path(tmp) / "out.pt", list(SIZES))
    print(table(compare(measured)))


if __name__ == "__main__":
    main()
