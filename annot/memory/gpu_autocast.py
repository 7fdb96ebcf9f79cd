"""CUDA autocast's casting rules, applied to a trace on CPU fake tensors (issue #31).

The planner traces on the CPU, and ``torch.autocast("cpu")`` casts by the CPU's op lists,
which keep softmax, layer_norm, exp and sum in the 16-bit dtype where CUDA autocast runs
them in float32: what they save for backward is then half what a GPU keeps. `CudaAutocast`
is a ``TorchFunctionMode`` that casts as CUDA autocast does, above autograd (so the
casted tensors are what backward saves, as on the GPU):

- `LOWER`: CUDA's "ops that can autocast to float16/bfloat16" (matmuls, linear,
  convolutions, attention) run in the 16-bit dtype; a parameter's cast is cached for
  the mode's life, as autocast caches leaf tensors that require grad (not under
  ``no_grad``, as torch does not);
- `FP32`: CUDA's "ops that can autocast to float32" (pointwise transcendental ops, the
  norms, softmax and the losses, reductions that take a dtype) run in float32.

Source: the op lists of torch's "Automatic Mixed Precision package - torch.amp" page
(sections "CUDA Ops that can autocast to float16" and "CUDA Ops that can autocast to
float32", torch 2.x), as Python-level function names. Ops on neither list run in the
dtype of their inputs (autocast's promotion of mixed inputs is torch's own type
promotion here). Attention is traced as the math of ``scaled_dot_product_attention``'s
CPU kernel; on Ampere and Hopper with 16-bit inputs the GPU picks flash attention, which
saves only the output and the log-sum-exp (the trace's figure for attention is then an
upper bound).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["FP32", "LOWER", "CudaAutocast"]


def _names(*functions: Any) -> frozenset[str]:
    return frozenset(getattr(f, "__name__", str(f)) for f in functions)


#: Functions CUDA autocast runs in the 16-bit dtype.
LOWER = _names(F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
               torch.addbmm, torch.mv, torch.addmv, torch.addr, torch.einsum, torch.chain_matmul,
               F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
               F.conv_transpose3d, F.prelu, F.scaled_dot_product_attention) | {"__matmul__", "__rmatmul__"}
#: Functions CUDA autocast runs in float32.
FP32 = _names(torch.acos, torch.asin, torch.cosh, torch.erfinv, torch.exp, torch.expm1, torch.log,
              torch.log10, torch.log2, torch.log1p, torch.reciprocal, torch.rsqrt, torch.sinh,
              torch.tan, torch.pow, F.softplus, F.layer_norm, F.group_norm, torch.norm,
              F.cosine_similarity, F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss,
              F.hinge_embedding_loss, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
              F.mse_loss, F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss,
              F.triplet_margin_loss, F.multi_margin_loss, F.binary_cross_entropy_with_logits,
              torch.dist, torch.cdist, torch.renorm, torch.logsumexp, torch.softmax,
              torch.log_softmax, F.softmax, F.log_softmax, F.cross_entropy, torch.cumsum,
              torch.cumprod, torch.prod, torch.sum) | {"__pow__", "__rpow__"}


class CudaAutocast(TorchFunctionMode):
    """Cast as CUDA autocast does with ``dtype`` (see the module docstring)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}
        self._caching = True

    def stop_caching(self) -> None:
        """Drop the cached casts and cache no more (a recomputation in backward casts
        again, as autocast on a GPU does)."""
        self._cache.clear()
        self._caching = False

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOWER:
            args, kwargs = tree_map(self._lower, (args, kwargs))
        elif name in FP32:
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> Any:
        self._cache.clear()  # as autocast drops its cast cache when its region ends
        return super().__exit__(*exc)

    def _lower(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == self.dtype:
            return value
        # autocast's cast cache, which holds no cast made under no_grad: one made there has
        # no graph, and a later call with gradients that reused it would give its weight
        # none (HRM runs its early cycles under no_grad; the trace then saved fewer tensors
        # than the checkpointed recomputation, which raised).
        if self._caching and torch.is_grad_enabled() and value.is_leaf and value.requires_grad:
            key = id(value)
            if key not in self._cache:
                with torch._C.DisableTorchFunction():
                    self._cache[key] = value.to(self.dtype)
            return self._cache[key]
        with torch._C.DisableTorchFunction():
            return value.to(self.dtype)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        with torch._C.DisableTorchFunction():
            return value.float()
    return value
