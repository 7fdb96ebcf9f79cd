"""The example GPT the single-process engine tests share: built from one seed, a batch of
tokens for it, and a counter of the blocks recomputed in backward."""

from __future__ import annotations

import torch

from examples.gpt.model import GPT

N_LAYER = 4


def gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=N_LAYER, **overrides)  # the example's defaults otherwise


def tokens(model: GPT, batch: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    size = (batch, model.config.block_size)
    return torch.randint(0, model.config.vocab_size, size, generator=gen)


class RecomputeCounter:
    """Counts block MLP forwards started during backward. A pre-hook, because the
    non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt."""

    def __init__(self, model: GPT) -> None:
        self.in_backward = False
        self.calls = 0
        self.backward_calls = 0
        for block in model.transformer.h:
            block.mlp.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1
        self.backward_calls += self.in_backward

    def step(self, model: GPT) -> torch.Tensor:
        idx = tokens(model, batch=2)
        _, loss = model(idx, idx)
        self.in_backward = True
        loss.backward()
        self.in_backward = False
        return loss
