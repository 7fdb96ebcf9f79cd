"""Run under torchrun: train the example GPT with each named strategy and count the peak
of live tensor bytes per rank (`annot.memory.counting.LiveBytes`).

    python -m torch.distributed.run --nproc_per_node 2 memory_worker.py OUT SPEC_JSON

SPEC_JSON: ``{"shape": {...GPT kwargs}, "batch": B, "seq": T, "steps": N,
"scenarios": [[strategy_key, checkpoint], ...]}``. For each scenario the model is built
under `annot.meta_init` and wrapped by `annot.auto_wrap` with the strategy's own engine
and options, all inside the counter; the peak is taken over the training steps only
(from the first forward of step 1 to the end of the last step), so it is the
steady-state peak the planner predicts (AdamW's states exist from step 1's optimizer
step on). Rank 0 saves, per scenario, every rank's peak and its peak by phase.
"""

from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist

import annot
from annot.memory.counting import LiveBytes
from annot.memory.strategies import strategy
from tests.distributed import worker_main


def make_optimizer(params) -> torch.optim.Optimizer:
    # foreach=True as on a GPU (torch's default there; on CPU it defaults to the
    # per-parameter loop), so the optimizer step allocates what it does on a GPU.
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def measure(key: str, checkpoint: bool, spec: dict) -> dict:
    from examples.gpt.model import GPT

    chosen = strategy(key)
    counter = LiveBytes()
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    batch, seq, vocab = spec["batch"], spec["seq"], spec["shape"]["vocab_size"]
    with counter:
        torch.manual_seed(0)
        with annot.meta_init():
            model = GPT(**spec["shape"])
        trainer = annot.auto_wrap(model, chosen.engine, checkpoint=checkpoint,
                                  optimizer=make_optimizer, **chosen.engine_options("fp32"))
        after_wrap = counter.current
        counter.reset_peak()
        counter.phase_peaks.clear()
        for _ in range(spec["steps"]):
            data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            x, y = data[:, :-1], data[:, 1:]
            counter.phase("forward")
            loss = trainer(x, y)[1]  # the logits are not kept (nor does the planner)
            counter.phase("backward")
            trainer.backward(loss)
            counter.phase("step")
            trainer.step()
            trainer.zero_grad()
            del data, x, y, loss
        counter.phase(None)
    result = {"peak": counter.peak, "phases": dict(counter.phase_peaks), "after_wrap": after_wrap}
    del trainer, model
    gc.collect()
    return result


def run(spec_json: str) -> dict:
    spec = json.loads(spec_json)
    out = {}
    for key, checkpoint in spec["scenarios"]:
        mine = measure(key, checkpoint, spec)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[f"{key}{'+ckpt' if checkpoint else ''}"] = every
    return out


if __name__ == "__main__":
    worker_main(run)
