"""Tiny mixture-of-experts models (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss), the batches
their ranks train on, and the single-process reference they are compared with.

Shared by ``test_moe.py`` (single process) and ``moe_worker.py`` (under torchrun). Each
model: hidden 64, 2 layers, 4 experts, top-2, dropout 0, built from ``SEED``. Mixtral,
Qwen3-MoE and gpt-oss compute the auxiliary load-balancing loss
(``output_router_logits=True``, coefficient 0.1 so it moves the gradients visibly);
DeepSeek-V3 has none (its router balances with a bias, not a loss).

Each rank trains on rows of its own, so each routes other tokens to other experts. The
loss annot's engines train is the mean over ranks of each rank's loss (every gradient is
averaged across ranks); the load-balancing loss is not linear in the tokens, so the
reference computes exactly that: the plain model's loss on each rank's rows, averaged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

SEED = 0
WORLD_SIZE = 2
ROWS_PER_RANK = 2
SEQ = 8
VOCAB = 128
STEPS = 2
#: Loss relative, every gradient absolute (the issue's bounds): fp32, the order of
#: additions in the reductions is all that differs.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4
#: The total gradient norm the ``-clip`` scenarios clip to: below every model's norm at
#: each step here (about 3), so clipping always scales (the test checks it did).
CLIP_NORM = 1.0

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0, num_experts_per_tok=2)
_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)

#: name -> (config class, model class, config options)
MOE_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_BASE, **_AUX, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_BASE, **_AUX, num_experts=4, moe_intermediate_size=32, head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_BASE, n_routed_experts=4, moe_intermediate_size=32, n_group=1, topk_group=1,
                         first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16,
                         q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_BASE, **_AUX, num_local_experts=4, head_dim=16,
                     layer_types=["full_attention"] * 2,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


#: A model of the user's own built from transformers' Mixtral MoE block
#: (tests/huggingface/own_moe_model.py): no ``ep_plan``, no load-balancing loss.
OWN_MOE = "own_mixtral"
#: The models whose loss carries the load-balancing term.
AUX_LOSS = ("mixtral", "qwen3_moe", "gpt_oss")


def build(name: str) -> torch.nn.Module:
    """The model ``name`` (a key of `MOE_MODELS`, or `OWN_MOE`) from ``SEED``, eagerly,
    in training mode."""
    import transformers

    if name == OWN_MOE:
        from tests.huggingface.own_moe_model import OwnMoe

        options = {k: v for k, v in MOE_MODELS["mixtral"][2].items() if k not in _AUX}
        torch.manual_seed(SEED)
        return OwnMoe(transformers.MixtralConfig(**options)).train()
    config_class, model_class, options = MOE_MODELS[name]
    config = getattr(transformers, config_class)(**options)
    torch.manual_seed(SEED)
    return getattr(transformers, model_class)(config).train()


def batches(world: int = WORLD_SIZE) -> list[torch.Tensor]:
    """Token ids per step: ``world * ROWS_PER_RANK`` rows, rank r's are rows
    ``r*ROWS_PER_RANK:(r+1)*ROWS_PER_RANK``."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (world * ROWS_PER_RANK, SEQ), generator=gen)
            for _ in range(STEPS)]


def rank_rows(ids: torch.Tensor, rank: int) -> torch.Tensor:
    return ids[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@functools.cache  # several scenarios of one model share it; callers only read it
def reference(name: str, clip: bool = False, world: int = WORLD_SIZE) -> dict[str, list]:
    """The plain model in one process: at each step the mean of the per-rank losses, its
    gradient (every parameter, by name; clipped to `CLIP_NORM` with ``clip``, and the norm
    before clipping recorded), then an SGD step."""
    model = build(name)
    optimizer = make_optimizer(model.parameters())
    losses, grads, norms = [], [], []
    for ids in batches(world):
        per_rank = [model(input_ids=rank_rows(ids, r), labels=rank_rows(ids, r)).loss
                    for r in range(world)]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM).item())
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms}
