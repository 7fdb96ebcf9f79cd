"""The single-process reference the multi-process tests compare against: the bare model
trained in one process on the union of what the ranks see."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

Batch = TypeVar("Batch")


def train_reference(
    make_model: Callable[[], torch.nn.Module],
    batches: Iterable[Batch],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor],
    after_backward: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[list[float], torch.nn.Module]:
    """Build the model, build the optimizer over its parameters, and for each batch:
    ``loss_fn(model, batch)``, backward, ``after_backward(model)`` if given (to read the
    gradients), optimizer step, zero the gradients. Returns the loss at every step and
    the trained model."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model
