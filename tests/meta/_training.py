"""Three SGD steps on one fixed batch: what the meta workers train after materializing,
and the single-process reference the tests compare their losses with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.reference import train_reference

STEPS = 3
LR = 0.1


def batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))


def train(forward: Callable[[torch.Tensor], torch.Tensor], update: Callable[[torch.Tensor], None],
          vocab_size: int) -> list[float]:
    """``forward(idx) -> loss``; ``update(loss)`` runs backward and the optimizer step."""
    idx = batch(vocab_size)
    losses = []
    for _ in range(STEPS):
        loss = forward(idx)
        update(loss)
        losses.append(loss.item())
    return losses


def reference_losses(model: torch.nn.Module, vocab_size: int) -> list[float]:
    losses, _ = train_reference(lambda: model, [batch(vocab_size)] * STEPS,
                                lambda params: torch.optim.SGD(params, lr=LR),
                                lambda model, idx: model(idx, idx)[1])
    return losses
