"""The memory-budget chooser (`annot.fit_budget`) against counted bytes, and at scale.

    python examples/bench_budget.py          # 2-rank CPU runs of a 29M GPT at 3 budgets
    python examples/bench_budget.py --llama  # Llama-3-8B shape, 8 GPUs, seq 8192, 12-80 GiB
    python examples/bench_budget.py --solver # the solver alone on 128 blocks, timed
    python examples/bench_budget.py --simulate  # FSDP2 answers at world 8, FSDPMemTracker

Counted runs: budgets a quarter, a half and three quarters of the way from the FSDP2
peak with every block checkpointed to the peak with none; each answer's Plan is applied
with `annot.auto_wrap` on 2 CPU ranks (gloo) and 3 AdamW steps are counted with
`annot.memory.counting.LiveBytes` (as examples/bench_memory.py), beside the same steps
without checkpointing: the table gives the counted peak against the budget and against
``peak_bytes``, and the largest loss difference. On a CPU nothing is offloaded (the
cost model's ``cpu`` device has no host link): the choices are none, selective and
checkpoint.

Worker mode (what torchrun runs): ``bench_budget.py --worker OUT SPEC_JSON``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import annot  # noqa: E402
from annot.memory.budget import budget_solver  # noqa: E402
from annot.memory.counting import LiveBytes  # noqa: E402

#: 28.9M parameters: 8 blocks of width 512, a vocabulary of 8192.
SHAPE = dict(n_layer=8, n_embd=512, n_head=8, vocab_size=8192, block_size=256)
BATCH, SEQ, WORLD, STEPS = 4, 256, 2, 3
FRACTIONS = (0.25, 0.5, 0.75)
STRATEGIES = ("fsdp2",)
GiB = 2**30


def gpt_meta() -> torch.nn.Module:
    from examples.gpt.model import GPT

    with torch.device("meta"):
        return GPT(**SHAPE)


def gpt_answers() -> list[Any]:
    """The budgets between the all-checkpointed and the plain peak, and their answers."""
    solver = budget_solver(gpt_meta(), gpus=WORLD, batch=BATCH, seq=SEQ, precision="fp32",
                                 device="cpu", margin=0.0, reserve=0, strategies=STRATEGIES)
    s = solver.strategies[0]
    low = solver._memory(s, solver._traced(s, dict.fromkeys(solver.paths, "checkpoint"))).device
    high = solver._memory(s, solver._traced(s, dict.fromkeys(solver.paths, "none"))).device
    return [solver.fit(int(low + f * (high - low))) for f in FRACTIONS]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def run(plan_json: str | None, engine: str, options: dict[str, Any],
        device: torch.device) -> tuple[int, list[float]]:
    """This rank's counted peak over the steps and the losses, for one Plan (``None``:
    the model's own Plan without checkpointing)."""
    import torch.distributed as dist

    from examples.gpt.model import GPT

    counter = LiveBytes()
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    with counter:
        torch.manual_seed(0)
        with annot.meta_init():
            model = GPT(**SHAPE)
        if plan_json is None:
            trainer = annot.auto_wrap(model, engine, checkpoint=False, device=device,
                                      optimizer=make_optimizer, **options)
        else:
            trainer = annot.auto_wrap(model, engine, annot.Plan.from_json(plan_json), device=device,
                                      optimizer=make_optimizer, **options)
        counter.reset_peak()
        for _ in range(STEPS):
            data = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1), generator=gen)
            loss = trainer(data[:, :-1], data[:, 1:])[1]
            trainer.backward(loss)
            trainer.step()
            trainer.zero_grad()
            losses.append(loss.item())
            del data, loss
    del trainer, model
    gc.collect()
    return counter.peak, losses


def worker(out: str, spec_json: str) -> None:
    import torch.distributed as dist

    spec = json.loads(spec_json)
    device = annot.init_distributed("gloo", device="cpu")
    results = []
    for row in spec["rows"]:
        peak, losses = run(row["plan"], row["engine"], row["options"], device)
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        results.append({"peak": max(peaks), "losses": losses})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown (see tests/distributed.py, worker_main)


def counted(out: Path, answers: list[Any], timeout: float = 900) -> list[dict[str, Any]]:
    """One torchrun launch: the plain run, then each answer's; a row per answer."""
    from tests.distributed import torchrun

    rows = [{"plan": None, "engine": answers[0].engine, "options": answers[0].options}]
    rows += [{"plan": a.plan.to_json(), "engine": a.engine, "options": a.options} for a in answers]
    torchrun(__file__, "--worker", str(out), json.dumps({"rows": rows}), nproc=WORLD, timeout=timeout)
    plain, *chosen = json.loads(out.read_text())
    return [dict(budget=a.budget_bytes, predicted=a.peak_bytes, measured=r["peak"],
                 blocks=a.blocks, loss_diff=max(abs(x - y) for x, y in zip(r["losses"], plain["losses"],
                                                                           strict=True)),
                 plain_peak=plain["peak"])
            for a, r in zip(answers, chosen, strict=True)]


def llama_8b() -> torch.nn.Module:
    """Llama-3-8B's shape on the meta device (transformers' LlamaForCausalLM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


LLAMA_BUDGETS_GIB = (12, 16, 20, 24, 32, 40, 48, 64, 80)


def llama_rows(budgets: tuple[int, ...] = LLAMA_BUDGETS_GIB, **options: Any) -> list[dict[str, Any]]:
    """fit_budget for Llama-3-8B at 8 GPUs, batch 1, seq 8192 (H100 figures), per budget."""
    solver = budget_solver(llama_8b(), gpus=8, batch=1, seq=8192, precision="bf16-mixed",
                                 device="H100", **options)
    rows = []
    for gib in budgets:
        try:
            a = solver.fit(gib * GiB)
        except annot.BudgetError as exc:
            rows.append(dict(budget=gib * GiB, fits=False, why=str(exc)))
            continue
        rows.append(dict(budget=gib * GiB, fits=True, strategy=a.label, peak=a.peak_bytes,
                         step=a.step_time_s, all_checkpointed=a.checkpoint_all_step_s,
                         recomputed=a.recomputed, blocks=len(a.blocks),
                         choices={c: sum(v == c for v in a.blocks.values()) for c in set(a.blocks.values())}))
    return rows


#: The simulated world-8 check: a GPT of 0.11B parameters (12 blocks of width 768).
SIM_SHAPE = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, block_size=1024)
SIM_BATCH, SIM_SEQ, SIM_WORLD = 1, 1024, 8


def simulated_rows(fractions: tuple[float, ...] = FRACTIONS) -> list[dict[str, Any]]:
    """FSDP2 answers at ``SIM_WORLD`` ranks for budgets ``fractions`` of the way from the
    all-checkpointed to the plain peak, each applied (checkpointing and selective
    contexts by its Plan) and measured with torch's FSDPMemTracker under the fake
    process group (`examples.bench_memory.tracked_fsdp2_peak`), beside ``peak_bytes``."""
    from annot.memory.choices import device as cost_device
    from annot.runtime.activation_checkpoint import torch_checkpoint
    from annot.runtime.selective_checkpoint import apply_plan_checkpointing
    from examples.bench_memory import tracked_fsdp2_peak
    from examples.gpt.model import GPT

    with torch.device("meta"):
        meta = GPT(**SIM_SHAPE)
    # The cost model of an H100 without its host link: the simulation runs no offload.
    solver = budget_solver(meta, gpus=SIM_WORLD, batch=SIM_BATCH, seq=SIM_SEQ, precision="fp32",
                           device=cost_device("H100", host_bw=0.0), margin=0.0, reserve=0,
                           strategies=STRATEGIES)
    s = solver.strategies[0]
    low = solver._memory(s, solver._traced(s, dict.fromkeys(solver.paths, "checkpoint"))).device
    high = solver._memory(s, solver._traced(s, dict.fromkeys(solver.paths, "none"))).device
    size = dict(shape=SIM_SHAPE, batch=SIM_BATCH, seq=SIM_SEQ)
    rows = []
    for f in fractions:
        budget = int(low + f * (high - low))
        answer = solver.fit(budget)
        plan = answer.plan

        def prepare(model: torch.nn.Module, plan: Any = plan) -> None:
            apply_plan_checkpointing(model, plan, plan.paths("checkpoint"), torch_checkpoint)

        measured = tracked_fsdp2_peak(size, SIM_WORLD, plan, prepare)
        rows.append(dict(budget=budget, predicted=answer.peak_bytes, measured=measured,
                         blocks=answer.blocks))
    return rows


def solver_timing(blocks: int = 128) -> float:
    """Seconds `annot.memory.solver.solve` takes for ``blocks`` Llama-like blocks with
    five choices each, at a budget that mixes them."""
    from annot.memory.solver import solve

    held = [[10.0, 6.2, 1.0, 0.0, 0.0]] * blocks
    cost = [[0.0, 0.05, 0.33, 0.34, 0.2]] * blocks
    start = time.perf_counter()
    solve(held, cost, [blocks * 4.0] * blocks, blocks * 4.0)
    return time.perf_counter() - start


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
        return
    if "--solver" in sys.argv:
        print(f"solver, 128 blocks x 5 choices: {solver_timing():.3f} s")
        return
    if "--simulate" in sys.argv:
        print("| budget (MiB) | peak_bytes (MiB) | FSDPMemTracker (MiB) | tracker/predicted | choices |")
        print("|---:|---:|---:|---:|---|")
        for r in simulated_rows():
            choices = {c: sum(v == c for v in r["blocks"].values()) for c in set(r["blocks"].values())}
            print(f"| {r['budget'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} "
                  f"| {r['measured'] / r['predicted']:.3f} | {choices} |")
        return
    if "--llama" in sys.argv:
        print("| budget | strategy | peak (GiB) | step (s) | checkpoint all (s) | recomputed blocks | choices |")
        print("|---:|---|---:|---:|---:|---:|---|")
        for r in llama_rows():
            if not r["fits"]:
                print(f"| {r['budget'] / GiB:.0f} GiB | nothing fits | | | | | {r['why']} |")
                continue
            ca = f"{r['all_checkpointed']:.3f}" if r["all_checkpointed"] is not None else "-"
            print(f"| {r['budget'] / GiB:.0f} GiB | {r['strategy']} | {r['peak'] / GiB:.1f} | {r['step']:.3f} "
                  f"| {ca} | {r['recomputed']}/{r['blocks']} | {r['choices']} |")
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = counted(Path(tmp) / "out.json", gpt_answers())
    print("| budget (MiB) | peak_bytes (MiB) | counted (MiB) | counted/predicted | loss diff | choices |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        choices = {c: sum(v == c for v in r["blocks"].values()) for c in set(r["blocks"].values())}
        print(f"| {r['budget'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} "
              f"| {r['measured'] / r['predicted']:.3f} | {r['loss_diff']:.1e} | {choices} |")
    print(f"plain run (no checkpointing): {rows[0]['plain_peak'] / 2**20:.1f} MiB counted")


if __name__ == "__main__":
    main()
