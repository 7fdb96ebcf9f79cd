"""Init functions whose control flow depends on values, recorded as one opaque operation.

torch 2.13's ``nn.init.trunc_normal_`` samples by rejection (``while mask.any(): ...``),
which fake tensors cannot run: ``meta_init`` would fail on any model that uses it
(ViT, DeiT, Swin and many others through transformers' ``_init_weights``). Inside
``meta_init`` the function is routed to the custom operator ``annot::trunc_normal_``:
on fake tensors it only marks the tensor as written; on real tensors (when
`annot.materialize` replays the tape) it runs torch's own function on the global random
generator, so the values and the random stream are exactly those of eager construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["opaque_inits"]

_eager_trunc_normal = torch.nn.init._no_grad_trunc_normal_


@torch.library.custom_op("annot::trunc_normal_", mutates_args={"tensor"})
def _trunc_normal_op(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> None:
    _eager_trunc_normal(tensor, mean, std, a, b)


@_trunc_normal_op.register_fake
def _(tensor: torch.Tensor, mean: float, std: float, a: float, b: float) -> None:
    return None


def _recorded_trunc_normal(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    # A private generator cannot be replayed from the recorded global state: leave that
    # case to torch (it fails on fake tensors with torch's own message).
    if generator is not None or not isinstance(tensor, FakeTensor):
        return _eager_trunc_normal(tensor, mean, std, a, b, generator=generator)
    _trunc_normal_op(tensor, float(mean), float(std), float(a), float(b))
    return tensor


@contextlib.contextmanager
def opaque_inits() -> Iterator[None]:
    """Route value-dependent init functions to their opaque operators for the block."""
    # `nn.init.trunc_normal_` looks this name up in its module at call time, and
    # transformers' init helpers call `nn.init.trunc_normal_`, so one patch covers both.
    torch.nn.init._no_grad_trunc_normal_ = _recorded_trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = _eager_trunc_normal
