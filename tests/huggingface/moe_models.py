"""Tiny mixture-of-experts models (hidden 64, 2 layers, 4 experts, top 2) saved with
transformers' own ``save_pretrained``, which writes one key per expert (its reverse
conversion mapping; gpt-oss keeps fused keys). Shared by ``test_moe_load.py`` and its
2-rank worker ``moe_load_worker.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SEED = 0
VOCAB = 128
SEQ = 8
ROWS_PER_RANK = 2
WORLD_SIZE = 2
LOSS_RTOL = 1e-5  # fp32; what is left is the order of additions in gradient reductions
GRAD_ATOL = 1e-4

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)

# name -> (config class, model class, options). Mixtral renames ``block_sparse_moe`` and
# fuses w1/w3; Qwen3-MoE and DeepSeek-V3 fuse gate/up (DeepSeek-V3: one dense layer
# first, a shared expert, multi-head latent attention); gpt-oss stores fused experts.
# DeepSeek-V3 keeps as many key/value heads as attention heads, as its real configs do:
# its latent attention expands keys and values to every attention head, and with fewer
# key/value heads transformers 5.24 repeats them again (heads // num_key_value_heads)
# wherever SDPA does not take grouped heads (a mask, or value and query/key head sizes
# that differ): 4 query heads against 8 key heads, a broadcast error in a single process
# without annot.
MOE_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_COMMON, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                         n_shared_experts=1, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     head_dim=16)),
}


def config(name: str) -> Any:
    import transformers

    config_class, _, options = MOE_MODELS[name]
    return getattr(transformers, config_class)(**options)


def build(name: str) -> torch.nn.Module:
    """The model from ``SEED``, eagerly."""
    import transformers

    torch.manual_seed(SEED)
    return getattr(transformers, MOE_MODELS[name][1])(config(name))


def save(name: str, root: Path) -> Path:
    """``build(name)`` saved with ``save_pretrained`` under ``root / name``."""
    directory = root / name
    if not (directory / "config.json").exists():
        build(name).save_pretrained(directory)
    return directory


def batch(rows: int = WORLD_SIZE * ROWS_PER_RANK) -> dict[str, torch.Tensor]:
    """One causal-LM batch, the union of all ranks' rows (rank r: rows r*R:(r+1)*R)."""
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids.clone())


def rank_rows(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for k, v in full.items()}


def plain(directory: Path) -> torch.nn.Module:
    """transformers' own single-process load of ``directory``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory)
