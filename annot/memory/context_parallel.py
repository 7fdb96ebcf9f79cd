"""Context-parallel layouts in the planner: FSDP2 with each sequence split over ``cp``
ranks (`annot.runtime.context_parallel`), what they cost beyond the traced step.

A cp row is traced at the sequence one rank holds (``seq / cp``): its activations,
FLOPs and tokens are that trace's. Three things the local trace does not see are added
here, from the model's attention shape (`attention_shape`):

- memory: each attention call gathers the whole sequence's keys and values, and SDPA
  keeps them for backward: ``(cp-1)/cp`` of them more than the trace saw, in every
  attention layer without checkpointing, in the one layer being recomputed with it;
- communication, on the ``cp`` dimension: the all-gather of keys and values in every
  forward (again in recomputation), and the all-reduce of their gradients in backward
  (annot's backward all-reduces and slices; `annot.runtime.split_attention`);
- FLOPs: the local queries' scores and weighted sums against the other ranks' keys
  (causal: half of them), forward, backward and recomputation.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from annot.memory.communication import Collective
from annot.memory.strategies import MemoryInputError, Strategy

__all__ = ["AttentionShape", "attention_shape", "cp_collectives", "cp_extra_flops",
           "cp_gathered_bytes", "cp_strategies"]


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Attention layers, and the width of their queries and of their keys (= values)."""

    layers: int
    query_width: int
    kv_width: int


def attention_shape(model: nn.Module) -> AttentionShape:
    """From a transformers config (``num_hidden_layers``, heads, key/value heads,
    ``head_dim``) or a minGPT-style one (``n_layer``, ``n_embd``); a `MemoryInputError`
    when the model has neither."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not (layers and hidden and heads):
        raise MemoryInputError(
            f"{type(model).__name__}: context-parallel rows need the attention's shape, read from "
            "model.config (num_hidden_layers, hidden_size, num_attention_heads, or n_layer, "
            "n_embd, n_head); pass cp=() to leave them out")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return AttentionShape(layers=int(layers), query_width=int(heads * head_dim),
                          kv_width=int(kv_heads * head_dim))


def cp_strategies(sizes: tuple[int, ...], gpus_per_node: int, world: int) -> tuple[Strategy, ...]:
    """``FSDP2 + CP c`` for each ``c`` of ``sizes`` (a `MemoryInputError` for one that does
    not divide the ranks of a node: the cp group's collectives run every layer, so it stays
    inside a node); parameters sharded over every rank (``shard x cp``)."""
    found = []
    for c in sizes:
        if c < 2 or gpus_per_node % c:
            raise MemoryInputError(
                f"cp={c}: a context-parallel group is 2 or more ranks of one node, and "
                f"{gpus_per_node} GPUs per node do not divide into groups of {c}")
        found.append(Strategy(f"fsdp2-cp{c}", f"FSDP2 + CP {c}", "fsdp2", (),
                              (("shard", world // c), ("cp", c))))
    return tuple(found)


def _kv_elements(shape: AttentionShape, batch: int, seq: int) -> int:
    """Keys and values of the whole sequence of one attention layer."""
    return 2 * batch * seq * shape.kv_width


def cp_gathered_bytes(shape: AttentionShape, *, batch: int, seq: int, cp: int,
                      act_bytes: int, checkpoint: bool) -> int:
    """Bytes of other ranks' keys and values a rank holds at the backward peak (``seq``:
    the whole sequence)."""
    layers = 1 if checkpoint else shape.layers
    return layers * _kv_elements(shape, batch, seq) * (cp - 1) // cp * act_bytes


def cp_collectives(shape: AttentionShape, *, batch: int, seq: int, cp: int, act_bytes: int,
                   checkpoint: bool) -> list[Collective]:
    """The cp group's collectives of one step (``seq``: the whole sequence)."""
    size = shape.layers * _kv_elements(shape, batch, seq) * act_bytes
    return [Collective("all-gather", "keys and values, forward", "cp", cp, size),
            *([Collective("all-gather", "keys and values, recomputation", "cp", cp, size)]
              if checkpoint else []),
            Collective("all-reduce", "key and value gradients", "cp", cp, size)]


def cp_extra_flops(shape: AttentionShape, *, batch: int, seq: int, cp: int, checkpoint: bool) -> int:
    """FLOPs of a rank's queries against the keys of the other ranks, which a trace at
    ``seq / cp`` leaves out: two matmuls of ``2 x q x k x width`` in forward, twice that
    in backward, once more in recomputation; causal, so half of the pairs."""
    local = seq // cp
    pairs = batch * local * (seq - local)
    passes = 3 + (1 if checkpoint else 0)
    return shape.layers * passes * 2 * 2 * pairs * shape.query_width // 2
