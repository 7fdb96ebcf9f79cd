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

Ulysses (``cp_attention="ulysses"``, `annot.runtime.ulysses_attention`) moves other
tensors: per attention layer an all-to-all of q, k, v and the output in forward (again
in recomputation) and of their gradients in backward, each rank sending ``(cp-1)/cp``
of its part; it gathers no keys and values (SDPA keeps the whole sequence for
``heads/cp`` heads: as many bytes as the local trace's q, k, v, so nothing is added),
except where key/value heads do not divide by cp and are repeated to the query heads
(the repeated copies, kept by SDPA, are added). Its FLOPs are the same as the
all-gather's: the whole sequence's causal attention, divided over the ranks.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from annot.memory.communication import Collective
from annot.memory.strategies import MemoryInputError, Strategy

__all__ = ["CP_ATTENTIONS", "AttentionShape", "attention_shape", "cp_collectives", "cp_extra_flops",
           "cp_gathered_bytes", "cp_strategies"]

#: The ways `annot.runtime.context_parallel` splits attention (FSDP2's ``cp_attention``).
CP_ATTENTIONS = ("allgather", "ulysses")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Attention layers, and the width of their queries and of their keys (= values)."""

    layers: int
    query_width: int
    kv_width: int
    #: Query heads and key/value heads (0: not known; Ulysses needs them).
    heads: int = 0
    kv_heads: int = 0

    def ulysses_kv_width(self, cp: int) -> int:
        """The key/value width Ulysses exchanges over ``cp`` ranks: the query width where
        the key/value heads are repeated (they do not divide by ``cp``)."""
        return self.kv_width if self.kv_heads % cp == 0 else self.query_width


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
                          kv_width=int(kv_heads * head_dim), heads=int(heads), kv_heads=int(kv_heads))


def cp_strategies(sizes: tuple[int, ...], gpus_per_node: int, world: int,
                  attention: str = "allgather") -> tuple[Strategy, ...]:
    """``FSDP2 + CP c`` for each ``c`` of ``sizes`` (a `MemoryInputError` for one that does
    not divide the ranks of a node: the cp group's collectives run every layer, so it stays
    inside a node); parameters sharded over every rank (``shard x cp``); ``attention``
    one of `CP_ATTENTIONS` (Ulysses as the option ``cp_attention``)."""
    if attention not in CP_ATTENTIONS:
        raise MemoryInputError(f"cp_attention={attention!r}: choose one of {', '.join(CP_ATTENTIONS)}")
    ulysses = attention == "ulysses"
    found = []
    for c in sizes:
        if c < 2 or gpus_per_node % c:
            raise MemoryInputError(
                f"cp={c}: a context-parallel group is 2 or more ranks of one node, and "
                f"{gpus_per_node} GPUs per node do not divide into groups of {c}")
        found.append(Strategy(f"fsdp2-cp{c}", f"FSDP2 + CP {c}" + (" Ulysses" if ulysses else ""),
                              "fsdp2", (("cp_attention", "ulysses"),) if ulysses else (),
                              (("shard", world // c), ("cp", c))))
    return tuple(found)


def _kv_elements(shape: AttentionShape, batch: int, seq: int) -> int:
    """Keys and values of the whole sequence of one attention layer."""
    return 2 * batch * seq * shape.kv_width


def cp_gathered_bytes(shape: AttentionShape, *, batch: int, seq: int, cp: int,
                      act_bytes: int, checkpoint: bool, attention: str = "allgather") -> int:
    """Bytes of other ranks' keys and values a rank holds at the backward peak (``seq``:
    the whole sequence); for Ulysses, the repeated key/value heads' copies only."""
    layers = 1 if checkpoint else shape.layers
    if attention == "ulysses":
        repeated = shape.ulysses_kv_width(cp) - shape.kv_width
        return layers * 2 * batch * (seq // cp) * repeated * act_bytes
    return layers * _kv_elements(shape, batch, seq) * (cp - 1) // cp * act_bytes


def cp_collectives(shape: AttentionShape, *, batch: int, seq: int, cp: int, act_bytes: int,
                   checkpoint: bool, attention: str = "allgather") -> list[Collective]:
    """The cp group's collectives of one step (``seq``: the whole sequence)."""
    if attention == "ulysses":
        return _ulysses_collectives(shape, batch=batch, seq=seq, cp=cp, act_bytes=act_bytes,
                                    checkpoint=checkpoint)
    size = shape.layers * _kv_elements(shape, batch, seq) * act_bytes
    return [Collective("all-gather", "keys and values, forward", "cp", cp, size),
            *([Collective("all-gather", "keys and values, recomputation", "cp", cp, size)]
              if checkpoint else []),
            Collective("all-reduce", "key and value gradients", "cp", cp, size)]


def _ulysses_collectives(shape: AttentionShape, *, batch: int, seq: int, cp: int,
                         act_bytes: int, checkpoint: bool) -> list[Collective]:
    """Ulysses' all-to-alls of one step, each ``size`` one rank's part (``seq / cp``
    tokens) of q, k, v and the output over every layer."""
    width = 2 * shape.query_width + 2 * shape.ulysses_kv_width(cp)  # q, out; k, v
    size = shape.layers * batch * (seq // cp) * width * act_bytes
    return [Collective("all-to-all", "q, k, v and output, forward", "cp", cp, size),
            *([Collective("all-to-all", "q, k, v and output, recomputation", "cp", cp, size)]
              if checkpoint else []),
            Collective("all-to-all", "their gradients, backward", "cp", cp, size)]


def cp_extra_flops(shape: AttentionShape, *, batch: int, seq: int, cp: int, checkpoint: bool) -> int:
    """FLOPs of a rank's queries against the keys of the other ranks, which a trace at
    ``seq / cp`` leaves out: two matmuls of ``2 x q x k x width`` in forward, twice that
    in backward, once more in recomputation; causal, so half of the pairs."""
    local = seq // cp
    pairs = batch * local * (seq - local)
    passes = 3 + (1 if checkpoint else 0)
    return shape.layers * passes * 2 * 2 * pairs * shape.query_width // 2
