"""Tensor parallel 2 x FSDP2 2 on 4 ranks: the models, the data, the mesh and the
single-process reference, shared by the test (pytest process) and its worker (torchrun).

Ranks (d, t) with t innermost: the two tensor-parallel ranks of a data-parallel group
see the same rows, the two data-parallel groups different ones. With equal row counts
the mean of the groups' losses is the loss on the union of their rows and FSDP2's
averaged gradients are its gradients, so losses and gradients must match one process
that trains on every row, up to float rounding.

- ``llama``: a tiny `transformers.LlamaForCausalLM` split by its own ``_tp_plan``
  (embedding by vocabulary rows, attention q/k/v and MLP gate/up column-wise, o/down
  row-wise, the head column-wise with its output gathered).
- ``gpt``: the example GPT (no plan of its own) split by a rule: each block's MLP
  ``c_fc`` column-wise and ``c_proj`` row-wise. Its attention stays whole: one fused
  q/k/v Linear cannot be split by output features (q, k and v would land on different
  ranks), and the refusal of splitting it is tested without a launch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.reference import train_reference

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
WORLD = 4
TP = 2
DP = WORLD // TP
ROWS = 2  # per data-parallel group and step
SEQ = 8
STEPS = 3
SEED = 0
# fp32; what is left is the order of float additions in the reductions.
TOLERANCE = 1e-6
LAUNCH_TIMEOUT_S = 300

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
GPT = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=SEQ)


def gpt_rule() -> Any:
    import annot

    return annot.tp_rule(colwise=["mlp.c_fc"], rowwise=["mlp.c_proj"])


def build(name: str, seed: int = SEED) -> nn.Module:
    """The model, built eagerly (or under ``annot.meta_init``) from ``seed``."""
    torch.manual_seed(seed)
    if name == "llama":
        import transformers

        config = transformers.LlamaConfig(**LLAMA, attention_dropout=0.0)
        return transformers.LlamaForCausalLM(config).train()
    from examples.gpt.model import GPT as Model

    return Model(**GPT)


def tp_plan(name: str) -> Any:
    """What auto_wrap's ``tp_plan=`` gets: the Llama's own plan (None), the GPT's rule."""
    return None if name == "llama" else gpt_rule()


def vocab(name: str) -> int:
    return LLAMA["vocab_size"] if name == "llama" else GPT["vocab_size"]


def batches(name: str) -> list[torch.Tensor]:
    """One batch of token ids per step: every data-parallel group's rows, in group order."""
    gen = torch.Generator().manual_seed(1)
    return list(torch.randint(0, vocab(name), (STEPS, DP * ROWS, SEQ + 1), generator=gen))


def group_rows(batch: torch.Tensor, group: int) -> torch.Tensor:
    return batch[group * ROWS:(group + 1) * ROWS]


def loss_fn(name: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    if name == "llama":
        return lambda model, ids: model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
    return lambda model, ids: model(ids[:, :-1], ids[:, 1:])[1]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(name: str) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Losses, every parameter's gradient at every step, and the final parameters of the
    bare model trained in one process on all rows."""
    grads: list[dict[str, torch.Tensor]] = []

    def record(model: nn.Module) -> None:
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    losses, model = train_reference(lambda: build(name), batches(name), make_optimizer,
                                    loss_fn(name), after_backward=record)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
