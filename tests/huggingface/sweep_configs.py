"""Tiny configs for every causal-LM architecture of the installed transformers (the
sweep, tests/huggingface/sweep_causal_lm.py).

One generic recipe instead of a table per family: start from the architecture's default
config and shrink every size field it has (hidden 64, 2 layers, 4 heads, 4 experts top-2
where it has experts, vocabulary 128), zero every dropout and router noise (training mode
must be deterministic: the sweep compares training steps), and keep lists that give one
entry per layer as long as the layers. A field the default config lacks is never added.
"""

from __future__ import annotations

from typing import Any

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
EXPERTS = 4
TOP_K = 2
EXPERT_INTERMEDIATE = 32
VOCAB = 128
MIN_POSITIONS = 64

# field -> tiny value; set only where the default config has the field (and, for the
# optional ones, a value that is not None: None there means "derived from another field").
_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim",
                     "hidden_dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "encoder_layers", "num_decoder_layers", "num_blocks"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num",
                     "n_kv_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_kv", "kv_channels",
                     "v_head_dim", "attention_head_size"), HEAD_DIM),
    **dict.fromkeys(("qk_head_dim",), 2 * HEAD_DIM),  # MLA: nope + rope parts
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    **dict.fromkeys(("mamba_n_heads",), HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff",
                     "ffn_hidden_size", "n_inner", "dense_intermediate_size", "mlp_hidden_dim",
                     "d_inner", "feed_forward_proj_dim", "mamba_d_ssm"), INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "shared_intermediate_size", "ffn_dim_moe", "expert_ffn_hidden_size"),
                    EXPERT_INTERMEDIATE),
    # LongCat-Flash's identity ("zero") experts beside the routed ones
    **dict.fromkeys(("zero_expert_num",), EXPERTS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token",
                     "num_selected_experts", "top_k", "moe_top_k", "router_top_k"), TOP_K),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_groups", "num_limited_groups"), 1),
    **dict.fromkeys(("kv_lora_rank",), 16),
    **dict.fromkeys(("q_lora_rank",), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM),
    **dict.fromkeys(("state_size", "d_state", "mamba_d_state", "ssm_state_size"), 8),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(("sliding_window", "attention_window"), 16),
}
# Set even where the default is None (None there would leave the model without a value).
_EVEN_IF_NONE = ("head_dim", "num_key_value_heads", "num_experts_per_tok")
# Fields one family's validation needs beyond the recipe (each its own rule, named).
SPECIAL: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "zaya": {"num_experts_per_tok": 1},  # its config accepts top-1 routing only
    "dots3_note_text": {"num_key_value_heads": HEADS},  # multi-head attention only
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gptj": {"rotary_dim": 8},
    # Its default layer types are all linear attention, which its own cache refuses.
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "codegen": {"rotary_dim": 8},
}
# Position tables: at least this long, so the planner's default trace and the batch fit.
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
# Per-layer lists: cut to the layer count.
_PER_LAYER = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern",
              "layers_type", "mlp_layer_types", "attn_type_list", "moe_layer_freq_list")


def _noise_free(key: str, value: Any) -> bool:
    """A float field that adds randomness in training mode (dropout, router jitter)."""
    return isinstance(value, float) and value > 0 and any(
        word in key for word in ("dropout", "pdrop", "jitter", "drop_prob", "drop_rate"))


def _layer_count(defaults: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(defaults.get(key), int):
            return defaults[key]
    return None


def _per_layer(values: list[Any] | str) -> list[Any] | str:
    """``LAYERS`` entries of a per-layer list keeping its variety: the first entries of
    distinct kinds (a hybrid keeps an attention layer beside a Mamba one), in the order
    they first occur, then repeats of the first."""
    try:
        distinct = list(dict.fromkeys(values))[:LAYERS]
    except TypeError:  # unhashable entries (lists): the first ones
        distinct = list(values[:LAYERS])
    cut = distinct + [values[0]] * (LAYERS - len(distinct))
    return "".join(cut) if isinstance(values, str) else cut


def tiny_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The config values that shrink ``defaults`` (a config's ``to_dict()``)."""
    out: dict[str, Any] = {}
    layers = _layer_count(defaults)
    for key, value in defaults.items():
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = _SIZES[key]
        elif key in _EVEN_IF_NONE and value is None:
            out[key] = _SIZES[key]
        elif isinstance(value, list) and value and (key in _PER_LAYER or len(value) == layers):
            out[key] = _per_layer(value)
        elif key in _PER_LAYER and isinstance(value, str):
            out[key] = _per_layer(value)
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
        elif key in _POSITIONS and isinstance(value, int) and value < MIN_POSITIONS:
            out[key] = MIN_POSITIONS
        elif _noise_free(key, value):
            out[key] = 0.0
        elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1
        elif key.endswith("token_id") and isinstance(value, list):
            out[key] = [v if not isinstance(v, int) or v < VOCAB else VOCAB - 1 for v in value]
        elif key == "is_decoder" and value is False:  # a causal LM head wants the causal mask
            out[key] = True
    if "expand" in defaults and {"num_heads", "head_dim"} <= defaults.keys():
        # Mamba-2 style: the heads span the expanded width.
        out["head_dim"] = HIDDEN * int(defaults["expand"]) // HEADS
    if "mamba_expand" in defaults and "mamba_d_head" in defaults:
        # the heads span the Mamba width: mamba_d_ssm where the config has one
        width = INTERMEDIATE if isinstance(defaults.get("mamba_d_ssm"), int) else \
            HIDDEN * int(defaults["mamba_expand"])
        out["mamba_d_head"] = width // HEADS
    if "kv_lora_rank" in defaults and "num_key_value_heads" in defaults:
        out["num_key_value_heads"] = HEADS  # multi-head latent attention: one kv head per head
    return out


def _nested(config: Any) -> list[tuple[str, Any]]:
    """Sub-configs of a composite config (``text_config``, ``vision_config``...)."""
    return [(name, getattr(config, name)) for name in getattr(config, "sub_configs", {}) or {}
            if getattr(config, name, None) is not None]


MULTIMODAL_WORDS = ("vision", "audio", "speech", "image", "video", "vq", "depth", "codec")


def multimodal_reason(config: Any) -> str | None:
    """Why ``config`` is a multimodal model the text-only sweep skips, or None."""
    for name, _ in _nested(config):
        if any(word in name for word in MULTIMODAL_WORDS):
            return f"multimodal: its config holds {name}"
    return None


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` (a key of transformers' auto mappings)."""
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    overrides = {**tiny_overrides(defaults.to_dict()), **SPECIAL.get(model_type, {})}
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    for name, sub in _nested(config):
        setattr(config, name, type(sub)(**{**sub.to_dict(), **tiny_overrides(sub.to_dict())}))
    _zero_noise(config)
    return config


def _zero_noise(config: Any) -> None:
    """Dropout and router noise off on the config and its sub-configs (attributes set
    after construction too: some configs derive them)."""
    for key, value in list(vars(config).items()):
        if _noise_free(key, value):
            setattr(config, key, 0.0)
    for _, sub in _nested(config):
        _zero_noise(sub)
