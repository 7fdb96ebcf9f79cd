"""Context parallelism on CPU ranks against one process on the whole sequences: the
models, the data and the reference, shared by the test (pytest process) and its worker
(torchrun).

Layouts: ``cp2`` (2 ranks, each sequence split over both), ``shard2xcp2`` (4 ranks:
two data-parallel groups of two cp ranks; ranks (s, c), c innermost), ``cp2xtp2`` (4
ranks, ranks (c, t), t innermost, one data-parallel group), all FSDP2, and
``cp2-deepspeed`` (``cp2`` on DeepSpeed ZeRO-3). The cp ranks of a
group get the same rows; annot splits them. Every row's labels count the same tokens,
so the mean of the groups' losses is the loss over every row, and losses and gradients
must match one process that trains on every row, up to float rounding.

- ``gpt``: the example GPT (SDPA, causal), checkpointing every block (so attention is
  recomputed in backward, under the split as well);
- ``llama``: a tiny `transformers.LlamaForCausalLM` with ``attn_implementation="sdpa"``
  and grouped-query attention (4 heads, 2 key/value heads), labels shifted by annot.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.reference import train_reference

WORKER = Path(__file__).with_name("context_parallel_worker.py")
LAYOUTS = {"cp2": dict(world=2, shard=1, cp=2), "shard2xcp2": dict(world=4, shard=2, cp=2),
           # DeepSpeed ZeRO-3 with cp 2 (Ulysses through DeepSpeed's DistributedAttention)
           "cp2-deepspeed": dict(world=2, shard=1, cp=2, engine="deepspeed"),
           # cp 2 x tp 2 on 4 ranks, tp innermost: the two cp ranks of a tp rank split the
           # sequence, the two tp ranks of a cp rank split the layers (the tensor-parallel
           # cases' plans: the Llama's own, the GPT's MLP rule)
           "cp2xtp2": dict(world=4, shard=1, cp=2, tp=2)}
ROWS = 2  # per data-parallel group and step
SEQ = 16  # 2 x cp chunks of 4 tokens (cp 2)
STEPS = 3
SEED = 0
# fp32; the split changes the order of float additions (softmax over gathered keys,
# gradients summed over ranks), nothing else.
TOLERANCE = 1e-5
LAUNCH_TIMEOUT_S = 300

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
GPT = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)


def build(name: str, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    if name == "llama":
        import transformers

        config = transformers.LlamaConfig(**LLAMA, attention_dropout=0.0)
        config._attn_implementation = "sdpa"
        return transformers.LlamaForCausalLM(config).train()
    from examples.gpt.model import GPT as Model

    return Model(**GPT)


def vocab(name: str) -> int:
    return LLAMA["vocab_size"] if name == "llama" else GPT["vocab_size"]


def batches(name: str, groups: int) -> list[torch.Tensor]:
    """One batch of token ids per step: every data-parallel group's rows, in group order."""
    gen = torch.Generator().manual_seed(1)
    return list(torch.randint(0, vocab(name), (STEPS, groups * ROWS, SEQ + 1), generator=gen))


def group_rows(batch: torch.Tensor, group: int) -> torch.Tensor:
    return batch[group * ROWS:(group + 1) * ROWS]


def loss_fn(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss as the user writes it, the same with and without context parallelism."""
    if name == "llama":
        return lambda model, ids: model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
    return lambda model, ids: model(ids[:, :-1], ids[:, 1:])[1]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(name: str, groups: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and every parameter's gradient at every step of the bare model trained in
    one process on every group's rows, whole sequences."""
    grads: list[dict[str, torch.Tensor]] = []

    def record(model: nn.Module) -> None:
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    losses, _ = train_reference(lambda: build(name), batches(name, groups), make_optimizer,
                                loss_fn(name), after_backward=record)
    return losses, grads
