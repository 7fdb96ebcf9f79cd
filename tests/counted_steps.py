"""The counted peak of a few training steps on one rank: what the planner's checks in
tests/quantization and tests/speed compare with.

`counted_peak` counts live tensor bytes (`annot.memory.counting.LiveBytes`, entered before
the model is built, so every storage is seen) while ``build()`` makes the wrapped model
and ``steps`` AdamW steps (torch's foreach step, as the planner prices) train it on
``batch`` sequences of ``seq`` random tokens; the peak is taken over the steps (reset
after the build)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from annot.memory.counting import LiveBytes


def counted_peak(build: Callable[[], nn.Module], *, batch: int, seq: int, lr: float, steps: int = 3,
                 after_step: Callable[[nn.Module], None] | None = None) -> int:
    """This rank's peak of live tensor bytes over ``steps`` steps (module docstring)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    counter = LiveBytes()
    with counter:
        model = build()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                      foreach=True)
        vocab = getattr(model, "module", model).get_input_embeddings().num_embeddings
        counter.reset_peak()
        for _ in range(steps):
            tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if after_step is not None:
                after_step(model)
            del tokens, loss
        del model, optimizer
        gc.collect()
    return counter.peak
