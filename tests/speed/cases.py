"""Shared by the float8 and compile tests and the worker they launch: the two models (the
example GPT, a tiny transformers Llama), their batches, and the single-process reference.

Each rank trains on its own half of a step's batch. The reference runs the same float8
model in one process on both halves, one after the other, and averages the two
gradients: (g0 + g1) / 2 is what DDP (g0/2 + g1/2) and FSDP2 ((g0 + g1) / 2) compute, to
the bit, since halving is exact in binary floating point. So losses and weights must be
bitwise equal, the float8 casts included: each half's scales come from the same
tensors in both runs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

#: The example GPT, a tiny transformers Llama, and karpathy/nanoGPT's model.py as published
#: (tests/rewriter/data/nanogpt_model.py: repository, path and commit in its header).
MODELS = ("gpt", "llama", "nanogpt")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
STEPS = 5
BATCH_PER_RANK = 2
SEQ = 32
VOCAB = 64
LR = 1e-3


def make_model(name: str) -> nn.Module:
    """The model ``name`` from seed 0: every linear's dimensions are multiples of 16.
    ``NAME-meta``: built under `annot.meta_init` (no memory; auto_wrap materializes it
    with the values eager construction gives); ``llama-lone``: the Llama (see `policy`)."""
    if name.endswith("-meta"):
        import annot

        with annot.meta_init():
            return make_model(name.removesuffix("-meta"))
    name = name.removesuffix("-lone")
    torch.manual_seed(0)
    if name == "nanogpt":
        nanogpt = _nanogpt()
        return nanogpt.GPT(nanogpt.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt":
        from examples.gpt.model import GPT

        return GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=SEQ)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=SEQ, tie_word_embeddings=False)
        return LlamaForCausalLM(config)
    raise ValueError(name)


def _nanogpt() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "rewriter" / "data" / "nanogpt_model.py"
    spec = importlib.util.spec_from_file_location("annot_test_nanogpt_speed", path)
    assert spec is not None and spec.loader is not None
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    module = importlib.util.module_from_spec(spec)
    # Registered, as an import would: dynamo looks the module of a traced function up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def policy(name: str) -> Any:
    """The policy auto_wrap gets for model ``name``: nanoGPT's file has no marks, so its
    ``Block`` by class, sharded and checkpointed; ``llama-lone``'s below; ``None`` (the
    marks, or transformers' metadata) for the others."""
    from annot.policies import Policy, by_class, by_name

    if name.startswith("nanogpt"):
        return Policy(shard=by_class("Block"), checkpoint=by_class("Block"))
    if name.endswith("-lone"):
        # Each MLP's down_proj a unit of its own: its one parameter a bias-less float8
        # weight, which FSDP2 would gather in a float8 buffer gloo cannot send (pitfall 70).
        layers, lone = by_class("LlamaDecoderLayer"), by_name("model.layers.*.mlp.down_proj")
        return Policy(shard=layers | lone, checkpoint=layers, float8=layers | lone)
    return None


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH_PER_RANK, SEQ), generator=gen)


def loss_of(name: str, model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token loss of model ``name`` (the GPT returns ``(logits, loss)``)."""
    if name.startswith(("gpt", "nanogpt")):
        return model(tokens, tokens)[1]
    return model(input_ids=tokens, labels=tokens).loss


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def float8_model(name: str, recipe: str | None, compile: Any = None) -> nn.Module:
    """``name``'s model with the float8 linears ``auto_wrap(float8=recipe)`` makes (the
    repeated blocks'), and, with ``compile`` (a backend), its blocks compiled: what the
    reference runs in one process."""
    import annot
    from annot.compiled_blocks import CompileOptions, compile_units
    from annot.float8 import apply_float8
    from annot.policies import Action
    from annot.policies.speed import with_speed_actions

    model = make_model(name)
    plan = with_speed_actions(annot.plan(model, policy(name)), model, float8=recipe or False,
                              compile=compile is not None)
    apply_float8(model, plan)
    if compile is not None:
        compile_units(model, plan.paths(Action.COMPILE), CompileOptions(backend=compile))
    return model


def reference(name: str, recipe: str | None, steps: int = STEPS, compile: Any = None
              ) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Per step each rank's loss, and the weights after ``steps`` steps, in one process."""
    model = float8_model(name, recipe, compile)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        grads: dict[str, torch.Tensor] = {}
        step_losses = []
        for rank in range(2):
            opt.zero_grad()
            loss = loss_of(name, model, batch(step, rank))
            loss.backward()
            step_losses.append(loss.item())
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] = grads[n] + p.grad if n in grads else p.grad.clone()
        for n, p in model.named_parameters():
            if n in grads:
                p.grad = grads[n] / 2
        opt.step()
        losses.append(step_losses)
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


def memory_model() -> nn.Module:
    """A Llama whose activations outweigh its weights at a few hundred tokens, for the
    planner's float8 check (every linear's dimensions multiples of 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                        max_position_embeddings=512, tie_word_embeddings=False))
