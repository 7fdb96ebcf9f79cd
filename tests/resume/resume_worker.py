"""Run under torchrun by test_resume.py: train, save and resume whole training states.

    torchrun ... resume_worker.py OUT save ROOT ENGINE [ENGINE ...] [kill]
    torchrun ... resume_worker.py OUT resume ROOT SAVED:ENGINE [SAVED:ENGINE ...]

``save``: for each engine, build the example GPT, wrap it with AdamW and a LambdaLR
schedule, train `SPLIT` steps, `annot.save_state` to ROOT/ENGINE, then train to `STEPS`
(the uninterrupted run: saving must not disturb it; the engines in `ASYNC` save
asynchronously, and commit after those steps). ``zero1-bf16`` is ZeRO-1 with bf16
parameters and fp32 gradient accumulation, for which DeepSpeed wraps the torch
optimizer in its ``BF16_Optimizer`` (issue #30). With ``kill`` last, the same FSDP2
run is saved at step 3 to ROOT/kill, trains a step, and rank 1 kills itself (SIGKILL)
while writing the step-4 save; OUT is written before that (the launch then fails).

``resume``: for each ``SAVED:ENGINE``, build ENGINE's run afresh in this new process,
`annot.load_state` ROOT/SAVED (any world size) and train the remaining steps.

Every step's global batch is the same `ROWS` rows, split evenly over the ranks, so the
mean of the ranks' losses is the loss of the whole batch on any world size. Each rank
seeds its RNG differently and records three draws after saving / loading (RNG states are
per rank). The CPU allocator's peak during each save and load is counted with the
profiler's memory events (bytes, relative to the start of the call). Both runs end with
a digest of every tensor this rank keeps of the parameters and the optimizer
(`final_state`), so a resumed run can be compared bitwise with the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import annot
from tests.distributed import gathered, worker_main

CONFIG = dict(n_layer=4, n_head=2, n_embd=64, vocab_size=128, block_size=16)
ROWS = 4
STEPS = 6
SPLIT = 3
ENGINES = {
    "fsdp2": dict(engine="fsdp2"),
    "fsdp1": dict(engine="fsdp1"),
    "ddp": dict(engine="ddp"),
    "zero2": dict(engine="deepspeed", stage=2),
    "zero3": dict(engine="deepspeed", stage=3),
    "zero1-bf16": dict(engine="deepspeed"),  # its config is written from the model: `options`
}
# Saved with async_save=True (committed after the following steps); the others in the
# foreground, so both paths are covered on a flat-sharding engine.
ASYNC = {"fsdp2", "fsdp1", "zero3"}


def options(name: str, model) -> dict:
    """``auto_wrap``'s engine keywords for ``name``."""
    if name != "zero1-bf16":
        return ENGINES[name]
    # bf16 parameters with fp32 gradient accumulation on ZeRO-1: DeepSpeed picks its
    # BF16_Optimizer instead of ZeRO's (the configuration of issue #30).
    config = annot.deepspeed_config(model, stage=1, precision="bf16")
    return dict(engine="deepspeed", config={**config, "data_types": {"grad_accum_dtype": "fp32"}})


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``step``'s global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CONFIG["vocab_size"], (ROWS, CONFIG["block_size"] + 1), generator=gen)
    per = ROWS // dist.get_world_size()
    rows = data[dist.get_rank() * per:(dist.get_rank() + 1) * per]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def build(name: str):
    """The example GPT (same weights on every rank) wrapped by ``name``'s engine, with
    AdamW (weight decay, so every state entry matters) and a warm-up LambdaLR."""
    from examples.gpt.model import GPT

    torch.manual_seed(0)
    model = GPT(**CONFIG, dropout=0.0)
    trainer = annot.auto_wrap(model, checkpoint=False, **options(name, model),
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1))
    # DeepSpeed's ZeRO optimizer is no torch Optimizer; the schedule drives the torch one
    # inside it, whose param groups ZeRO steps with.
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(100 + dist.get_rank())  # per-rank RNG streams (data order, dropout)
    return trainer, scheduler


def train(trainer, scheduler, steps: range) -> list[float]:
    losses = []
    for step in steps:
        _, loss = trainer(*batch(step))
        trainer.backward(loss)
        trainer.step()
        trainer.zero_grad()
        scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def peak_bytes(call):
    """``call()``'s result and the CPU allocator's peak above its level at the start
    (the profiler's allocation events; each rank counts its own)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == "[memory]":
            events.append((node.start_time_ns, node.extra_fields.alloc_size,
                           node.extra_fields.total_allocated))
        stack += node.children
    if not events:
        return result, 0
    events.sort()
    # The allocator's running total counts what earlier profiled calls left alive too:
    # measure from its level just before this call's first allocation.
    base = events[0][2] - events[0][1]
    return result, max(total for _, _, total in events) - base


def state_bytes() -> dict:
    """Bytes of the whole model and of the whole optimizer state (AdamW: two fp32
    tensors per parameter; the step counters are negligible)."""
    from examples.gpt.model import GPT

    with torch.device("meta"):
        full = sum(p.numel() * 4 for p in GPT(**CONFIG).parameters())
    return {"model": full, "optimizer": 2 * full}


def _digest(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    raw = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{local.dtype} {tuple(local.shape)} {hashlib.sha256(raw.numpy().tobytes()).hexdigest()}"


def final_state(trainer) -> dict[str, str]:
    """A digest of every tensor this rank keeps of the model (`local_values`) and of the
    optimizer: each tensor the torch optimizer steps (a ZeRO fp32 partition, an FSDP1
    flat view, a DTensor's rows) and its state, read from the engine's own objects, not
    through annot's checkpoint code."""
    out = {f"param {i}": _digest(v) for i, v in enumerate(local_values(trainer))}
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    for g, group in enumerate(inner.param_groups):
        for i, stepped in enumerate(group["params"]):
            out[f"optimizer {g}.{i}"] = _digest(stepped)
            for key, value in sorted(inner.state.get(stepped, {}).items()):
                if isinstance(value, torch.Tensor):
                    out[f"optimizer {g}.{i} {key}"] = _digest(value)
    return out


def save_run(root: Path, name: str) -> dict:
    trainer, scheduler = build(name)
    losses = train(trainer, scheduler, range(SPLIT))
    # Asynchronous: written while the next steps train, committed after.
    background = name in ASYNC
    saved, peak = peak_bytes(lambda: annot.save_state(root / name, trainer, step=SPLIT,
                                                      scheduler=scheduler,
                                                      extra={"epoch": 0, "next_row": SPLIT * ROWS},
                                                      keep_last=1, async_save=background))
    draws = torch.rand(3).tolist()
    losses += train(trainer, scheduler, range(SPLIT, STEPS))
    if background:
        saved = saved.wait()
    return {"losses": losses, "saved": str(saved), "draws": gathered(draws),
            "save_peak": gathered(peak), "bytes": state_bytes(),
            "final": gathered(final_state(trainer)), "optimizer": type(trainer.optimizer).__name__}


def local_values(trainer) -> list[torch.Tensor]:
    """What this rank keeps of each parameter (a DTensor's rows, an FSDP1 flat view, a
    ZeRO-3 partition, a whole tensor), copied."""
    out = []
    for param in trainer.model.parameters():
        value = getattr(param, "ds_tensor", None)
        if value is None:
            value = param.data.to_local() if hasattr(param.data, "to_local") else param.data
        out.append(value.detach().clone())
    return out


def resume_run(root: Path, saved: str, name: str) -> dict:
    trainer, scheduler = build(name)
    weights_only = None
    if saved == name:  # annot.load reads the model out of the same state first
        target = trainer.module if name == "fsdp1" else trainer.model
        annot.load(target, annot.latest_state(root / saved))
        weights_only = local_values(trainer)
    resumed, peak = peak_bytes(lambda: annot.load_state(root / saved, trainer, scheduler=scheduler))
    same_weights = None if weights_only is None else all(
        torch.equal(a, b) for a, b in zip(weights_only, local_values(trainer), strict=True))
    draws = torch.rand(3).tolist()
    losses = train(trainer, scheduler, range(resumed.step, STEPS))
    return {"losses": losses, "step": resumed.step, "extra": resumed.extra,
            "rng_restored": resumed.rng_restored, "draws": gathered(draws),
            "load_peak": gathered(peak), "lr": scheduler.get_last_lr(),
            "annot_load_matches": gathered(same_weights), "final": gathered(final_state(trainer))}


def kill_during_save(root: Path, out: str, results: dict) -> None:
    """A good save at step 3, one more step, then rank 1 dies inside the step-4 save,
    after writing its data file, before anything is committed."""
    from torch.distributed.checkpoint import FileSystemWriter

    trainer, scheduler = build("fsdp2")
    train(trainer, scheduler, range(SPLIT))
    annot.save_state(root / "kill", trainer, step=SPLIT, scheduler=scheduler)
    train(trainer, scheduler, range(SPLIT, SPLIT + 1))
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        if dist.get_rank() == 1:
            future.wait()
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    annot.save_state(root / "kill", trainer, step=SPLIT + 1, scheduler=scheduler)
    raise AssertionError("rank survived its own SIGKILL")


def run(mode: str, root: str, *names: str) -> dict:
    root_path = Path(root)
    results: dict = {"world": dist.get_world_size()}
    for name in names:
        if mode == "save" and name == "kill":
            kill_during_save(root_path, sys.argv[1], results)
        elif mode == "save":
            results[name] = save_run(root_path, name)
        else:
            saved, engine = name.split(":")
            results[name] = resume_run(root_path, saved, engine)
    return results


if __name__ == "__main__":
    worker_main(run)
