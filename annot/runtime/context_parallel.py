"""Context parallelism at run time: a batch's sequences split over the ranks of a group.

`ContextParallel` is what the `Trainable` of FSDP2 or DeepSpeed holds when the parallel
dims have a ``"cp"`` dimension of more than one rank. Around each call of the model it

1. splits every sequence tensor the call is given (dim 1 of the first tensor's length
   ``T``: inputs, labels, position ids, an all-ones attention mask) into ``2 x cp``
   chunks and gives rank ``r`` chunks ``r`` and ``2cp-1-r`` (`token_places`): under a
   causal mask a token attends to the tokens before it, so early chunks cost little
   and late ones much; pairing them gives every rank the same work (torchtitan's
   load-balanced order);
2. passes the position ids of those tokens (``position_ids``, which the model's
   forward must take: a forward that counts positions from 0 would give the second
   chunk the first chunk's positions) and, for a transformers model given ``labels``,
   the labels already shifted (``shift_labels``: the loss must not shift inside a
   chunk, which would pair a chunk's last token with the next chunk's first);
3. runs the forward under `SplitAttention` (each SDPA call attends over the whole
   sequence: by an all-gather of keys and values, or Ulysses' all-to-all over heads,
   `annot.runtime.ulysses_attention`), checking on the first call that every attention module calls SDPA;
4. replaces the loss the model returns (each rank's mean over its own tokens) by the
   loss over the whole sequence, ``sum_r loss_r x n_r / N`` with ``n_r`` rank ``r``'s
   labelled tokens (labels -100 are not counted) and ``N`` their sum, all-reduced with
   autograd: every rank returns the same number, the one a single process gives, and
   its gradient is the full sequence's (docs/design.md, pitfall 37).

Backward must run under the same mode when activation checkpointing recomputes
attention: `Trainable.backward` enters `attention` again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from annot.runtime.split_attention import (
    AttentionCallCheck,
    AttentionFunction,
    SplitAttention,
    check_attention_modules,
    split_attention,
)
from annot.runtime.ulysses_attention import refuse_head_counts, ulysses_attention

__all__ = ["ATTENTIONS", "IGNORE_INDEX", "ContextParallel", "refuse_unsplittable", "token_places"]

#: The ways to split attention over the cp group, by the name FSDP2's ``cp_attention``
#: takes: the all-gather of keys and values (the default) and Ulysses' all-to-all.
ATTENTIONS: dict[str, AttentionFunction] = {"allgather": split_attention,
                                            "ulysses": ulysses_attention}

#: Labels with this value are not counted (torch's and transformers' ignore index).
IGNORE_INDEX = -100


def token_places(length: int, size: int, rank: int) -> torch.Tensor:
    """The places in a sequence of ``length`` tokens that rank ``rank`` of ``size`` holds:
    chunks ``rank`` and ``2*size-1-rank`` of ``2*size`` equal chunks (a `ValueError`
    naming the fix when ``length`` is not a multiple of ``2*size``)."""
    if length % (2 * size):
        raise ValueError(
            f"context parallelism over {size} ranks splits each sequence into {2 * size} equal "
            f"chunks, and {length} tokens do not divide: pad sequences to a multiple of "
            f"{2 * size} (with labels -100, which the loss does not count)")
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def refuse_unsplittable(model: nn.Module, cp: int = 1, attention: str = "allgather") -> None:
    """Refuse, before the model changes, a model context parallelism would compute wrong:
    a forward without ``position_ids``, attention known not to call SDPA, and for
    ``attention="ulysses"`` over ``cp`` ranks a config's query heads that do not divide
    (a model without a config is checked at its first call)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"cp_attention={attention!r}: choose one of {sorted(ATTENTIONS)}")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{type(model).__name__}.forward takes no position_ids: under context "
            "parallelism each rank holds two chunks of every sequence, and a forward that "
            "numbers positions from 0 would give them the wrong ones. Add a position_ids "
            "argument (annot passes each token's place in the sequence)")
    check_attention_modules(model)
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "n_head"):  # transformers', minGPT's
        heads = getattr(config, name, None)
        if attention == "ulysses" and isinstance(heads, int):
            refuse_head_counts(heads, cp, f"{type(model).__name__} (config.{name})")
            break


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ContextParallel:
    """The sequence split of one context-parallel group (``group``: this rank's ``"cp"``
    mesh dimension) for ``model`` (the bare model, whose forward's parameters name the
    arguments); ``attention`` names how SDPA is split (`ATTENTIONS`), ``function``
    replaces that name's implementation (same signature)."""

    def __init__(self, group: dist.ProcessGroup, model: nn.Module,
                 attention: str = "allgather", function: AttentionFunction | None = None) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.model = model
        self.signature = inspect.signature(model.forward)
        self.transformers = hasattr(model, "loss_function")  # a PreTrainedModel with a loss
        self._checked = False
        self._mode: SplitAttention | None = None
        refuse_unsplittable(model, self.size, attention)
        # An engine may bring its own implementation of the named way (DeepSpeed's Ulysses).
        self.function = function if function is not None else ATTENTIONS[attention]

    def attention(self) -> SplitAttention:
        """The attention mode of the last call (for backward's recomputation)."""
        if self._mode is None:
            raise RuntimeError("backward before any forward under context parallelism")
        return self._mode

    def call(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``forward(*args, **kwargs)`` on this rank's part of the sequences, with the
        loss it returns replaced by the whole sequence's (module docstring)."""
        bound = self.signature.bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        # A **kwargs parameter binds as one dict; its entries are arguments too.
        for name, param in self.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
        first = next((v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
        if first is None:
            raise ValueError("context parallelism: the call has no (batch, sequence) tensor to split")
        batch, length = first.shape[:2]
        self._complete(named, batch, length, first.device)
        places = token_places(length, self.size, self.rank)
        every = torch.cat([token_places(length, self.size, r) for r in range(self.size)])
        labels = named.get("shift_labels", named.get("targets", named.get("labels")))
        split = {k: v.index_select(1, places.to(v.device))
                 if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == length else v
                 for k, v in named.items()}
        self._mode = SplitAttention(self.group, places, every, self.function)
        check = None if self._checked else AttentionCallCheck(self.model, self._mode)
        try:
            with self._mode:
                output = forward(**split)
        finally:
            if check is not None:
                check.close()
                self._checked = True
        local = (split.get("shift_labels", split.get("targets", split.get("labels")))
                 if labels is not None else None)
        return self._reduce_loss(output, local)

    def _complete(self, named: dict[str, Any], batch: int, length: int, device: torch.device) -> None:
        """Add what splitting needs and the caller left out: position ids, an all-ones
        attention mask (a transformers model would otherwise read the two chunks' position
        ids as two packed sequences), shifted labels for a transformers model's loss."""
        if named.get("position_ids") is None:
            named["position_ids"] = torch.arange(length, device=device).expand(batch, length)
        params = self.signature.parameters
        mask = named.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if not bool(mask.bool().all()):
                raise ValueError(
                    "context parallelism cannot split an attention_mask that masks tokens "
                    "(padding): pad with labels -100 instead, and pass no attention_mask")
        elif "attention_mask" in params:
            named["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device=device)
        labels = named.get("labels")
        if self.transformers and isinstance(labels, torch.Tensor) and named.get("shift_labels") is None:
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            named["shift_labels"] = shifted

    def _reduce_loss(self, output: Any, labels: torch.Tensor | None) -> Any:
        """``output`` with its loss (a 0-d tensor: the output itself, an element of a
        tuple, or ``output["loss"]``) replaced by the whole sequence's loss."""
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return self._whole_loss(output, labels)
        if isinstance(output, tuple):
            return type(output)(self._whole_loss(o, labels) if _is_loss(o) else o for o in output)
        if hasattr(output, "keys") and _is_loss(output.get("loss")):
            output["loss"] = self._whole_loss(output["loss"], labels)
        return output

    def _whole_loss(self, loss: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if labels is None:
            counts = torch.ones(self.size, device=loss.device)
        else:
            mine = (labels != IGNORE_INDEX).sum().to(loss.device, torch.float64).reshape(1)
            gathered = [torch.empty_like(mine) for _ in range(self.size)]
            dist.all_gather(gathered, mine, group=self.group)
            counts = torch.cat(gathered)
        total = counts.sum()
        if total > 0 and bool((counts == 0).any()):
            # Every rank sees the counts, so every rank raises here: none waits alone.
            raise ValueError(
                f"context parallelism: rank(s) {(counts == 0).nonzero().flatten().tolist()} of "
                "the cp group hold no labelled token of this batch, so their mean loss is 0/0; "
                "put the padding (labels -100) where every rank keeps some labelled tokens")
        weight = (counts[self.rank] / total).to(loss.dtype) if total > 0 else 1.0 / self.size
        out: torch.Tensor = _SumOverGroup.apply(loss * weight, self.group)
        return out


def _is_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
