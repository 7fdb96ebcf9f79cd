"""Tiny configs for every causal-LM architecture of the installed transformers (the
sweep, tests/huggingface/sweep_causal_lm.py).

One generic recipe instead of a table per family: start from the architecture's default
config and shrink every size field it has (hidden 64, 2 layers, 4 heads, 4 experts top-2
where it has experts, vocabulary 128), zero every dropout and router noise (training mode
must be deterministic: the sweep compares training steps), and keep lists that give one
entry per layer as long as the layers. A field the default config lacks is never added.

The other heads (the class probe, tests/huggingface/probe_classes.py) take the
whole-model recipe, `tiny_whole_config` (``tiny_config(type, task)`` for any task but
``causal_lm``): the same sizes at every depth of the config tree, the vision and audio
towers shrunk too (depth, image 32 pixels in patches of at most 8, 16 mel bins, 16
source positions), lists of layer numbers mapped into the tiny depth, special token ids
kept distinct inside the tiny vocabulary, every source of training-mode noise zeroed,
and `TOWER_SPECIAL` where a family needs more (each entry with its reason). The
causal-LM recipe is kept as it was: that sweep's rows depend on it.
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


def tiny_config(model_type: str, task: str = "causal_lm") -> Any:
    """The tiny config of ``model_type`` (a key of transformers' auto mappings) for
    ``task`` (one of `TASKS`). ``causal_lm`` is the causal-LM sweep's recipe, which that
    sweep's rows depend on: it shrinks the top-level config and each direct sub-config
    alone. Every other task takes the whole-model recipe (`tiny_whole_config`), which
    shrinks the vision and audio towers too."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if task != "causal_lm":
        return tiny_whole_config(model_type)
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


# The whole-model recipe (every task but the causal-LM sweep's): the same sizes, applied at
# every depth of the config tree, plus the towers' own fields.

#: The tasks `tiny_config` serves: the causal-LM sweep's and the auto mappings of the
#: class probe (tests/huggingface/probe_classes.py).
TASKS = ("causal_lm", "image_text", "seq2seq", "speech_seq2seq", "multimodal_lm", "causal_multimodal", "masked_lm",
         "image_classification")
IMAGE = 32
# Token ids for the special tokens a default config leaves unset (BLIP-2's image token):
# below the ids `_token_ids` hands out from the top of the vocabulary.
SPARE_TOKEN = VOCAB - 40
PATCH = 8
MEL_BINS = 16
SOURCE_POSITIONS = 16  # Whisper-style encoders take 2 * this many frames
# Layer counts the causal-LM recipe does not know (towers, encoders, resamplers): at most LAYERS.
_TOWER_LAYERS = ("depth", "encoder_num_hidden_layers", "decoder_num_hidden_layers", "num_encoder_layers",
                 "speech_encoder_layers", "t2u_encoder_layers", "t2u_decoder_layers",
                 "conf_num_hidden_layers", "num_global_layers", "resampler_depth", "layers",
                 "aligner_num_add_layers", "num_timestamp_prediction_layers", "num_adapter_layers")
# Widths that name another tower's hidden size (a projector's input or output): every
# hidden size is HIDDEN here, so these are too.
_OTHER_HIDDEN = ("out_hidden_size", "text_hidden_size", "projector_hidden_size", "encoder_hidden_size",
                 "vision_hidden_size", "thinker_hidden_size", "cross_attention_hidden_size",
                 "cross_hidden_size", "output_hidden_size", "audio_hidden_size", "projection_dim",
                 "image_text_hidden_size", "moe_hidden_size", "downsample_hidden_size",
                 "vision_embed_dim", "text_embed_dim", "d_model_text",
                 "projection_hidden_size", "mm_hidden_size", "projector_input_dim", "projector_output_dim",
                 "mm_embed_dim", "output_proj_dims", "decoder_hidden_size", "adapter_in_dim", "adapter_out_dim",
                 "adapter_input_size")
# Lists of layer numbers (not one entry per layer): each number maps into the tiny depth.
_LAYER_INDEXES = ("fullatt_block_indexes", "deepstack_visual_indexes", "intermediate_layers_indices",
                  "global_attn_indexes", "cross_attention_layers", "moe_layers",
                  "look_ahead_layers", "look_backward_layers")
# Hidden-state picks: negative counts from the last layer, so they are clipped, not mapped.
_FEATURE_LAYERS = ("vision_feature_layer", "vision_feature_layers")
# Training-mode randomness beyond `_noise_free`'s words: stochastic depth, layer drop,
# SpecAugment-style masking of speech features.
_MORE_NOISE = ("drop_path", "layerdrop", "layer_drop", "mask_time_prob", "mask_feature_prob",
               "stochastic_depth")
# Per-stage lists of convolutional and hierarchical towers: one block per stage.
_STAGE_DEPTHS = ("depths", "num_layers_per_stage", "stage_depths")

def _letters(code: int) -> str:
    """Chameleon's spelling of an image code in its vocabulary: each digit as a letter."""
    return "".join(chr(ord("A") + int(digit)) for digit in str(code))


# The VQ image tokenizers' codebook, and the vocabulary ids its codes become (64..79).
_IMAGE_CODES = 16
_CODE_BASE = 64

# Fields one family's whole model needs beyond the recipe, each with its reason; a nested
# dict reaches into the sub-config of that name.
TOWER_SPECIAL: dict[str, dict[str, Any]] = {
    # -- image classification
    # Five stride-2 stages: a 32-pixel image is 1x1 before the last downsampling conv.
    "convnext": {"image_size": 64},
    "convnextv2": {"image_size": 64},
    "mobilevitv2": {"image_size": 64},
    # Swin clips a window to a smaller stage but keeps the bias table of the configured
    # window (transformers fails on 32-pixel images); 64 pixels in 4-pixel patches with
    # 2-patch windows keep every stage at least one window wide.
    "swin": {"image_size": 64, "window_size": 2},
    "donut-swin": {"image_size": 64, "window_size": 2},
    "swinv2": {"image_size": 64, "window_size": 2},
    # hidden_dim is the width its last conv derives from width_coefficient, not a size to pick.
    "efficientnet": {"hidden_dim": 2560},
    # patch_size is the stride of its 4-conv stem (fixed 16); the attention biases are
    # sized from image_size / 16.
    "levit": {"patch_size": 16, "image_size": 64},
    # Its classifier reads these two answer tokens' logits (defaults far beyond the tiny vocabulary).
    "shieldgemma2": {"yes_token_index": 10, "no_token_index": 11},
    # -- masked LM
    # ESM's default leaves the vocabulary to the checkpoint; ESM C has no grouped-query attention.
    "esm": {"vocab_size": VOCAB, "pad_token_id": 1, "mask_token_id": 3},
    "esmc": {"num_key_value_heads": HEADS},
    # The LM head widens the embedding to the hidden size: the embedding must be narrower.
    "mobilebert": {"embedding_size": 32, "intra_bottleneck_size": 32},
    "squeezebert": {"embedding_size": HIDDEN},
    # Axial positions: the two widths sum to the hidden size and, in training, the two
    # factors multiply to the sequence length (64); the chunks divide it.
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8],
                 "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16,
                 "hash_seed": 0},  # LSH draws random rotations each forward unless seeded
    # The latent array and its depth (not named like the recipe's sizes); the masked-LM
    # decoder has max_position_embeddings outputs, so the batch's sequence is that long.
    "perceiver": {"d_latents": HIDDEN, "num_latents": 16, "num_self_attends_per_block": LAYERS,
                  "num_self_attention_heads": HEADS, "num_cross_attention_heads": HEADS,
                  "max_position_embeddings": 64},
    # -- vision-language: default configs that build no model (fields left to the
    # checkpoint), given values.
    # Cohere Compass's RoPE is per layer type and empty by default.
    "cohere_compass": {"text_config": {"rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}}},
    # Granite 4 Vision's deepstack (vision layer -> text layer) pairs, its Q-Former window
    # rate, and the text layers of its 4 spatial offset groups.
    "granite4_vision": {"deepstack_layer_map": [[1, 0]], "downsample_rate": "1/2",
                        "spatial_target_layers": [1, 1, 1, 1]},
    # Qwen4-Exp's query-sparse attention indexer, and its hashed n-gram tables (20M rows
    # by default).
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                                  "indexer_budget": 16, "indexer_compress_ratio": 4,
                                  "ngram_vocab_size_base": 1000, "split_ngram_parts": 1}},
    # Chameleon and Emu3 map each code of their VQ image tokenizer to a vocabulary token by
    # the checkpoint's vocabulary_map (none by default): one for a 16-code book, and the
    # tokenizer shrunk by its own field names.
    "chameleon": {"vocabulary_map": {"<image>": SPARE_TOKEN, **{
        f"IMGIMG{_letters(code)}Z": _CODE_BASE + code for code in range(_IMAGE_CODES)}},
        "vq_config": {"num_embeddings": _IMAGE_CODES, "resolution": IMAGE, "base_channels": 32,
                      "latent_channels": 32, "num_res_blocks": 1}},
    "emu3": {"vocabulary_map": {"<image>": SPARE_TOKEN, "<|extra_200|>": SPARE_TOKEN + 1, **{
        f"<|visual token {code:06d}|>": _CODE_BASE + code for code in range(_IMAGE_CODES)}},
        "vq_config": {"codebook_size": _IMAGE_CODES, "base_channels": 32, "num_res_blocks": 1,
                      "hidden_size": 32 * 4}},  # its attention runs at the last (x4) width
    # DeepSeek-OCR 2's dense or sparse MLP per layer.
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    # DiffusionGemma's experts (its router is built whether or not they are set).
    "diffusion_gemma": {"text_config": {"num_experts": EXPERTS, "top_k_experts": TOP_K,
                                        "moe_intermediate_size": EXPERT_INTERMEDIATE}},
    # -- vision-language: special tokens a default config leaves to the tokenizer.
    "blip-2": {"image_token_index": SPARE_TOKEN},
    "instructblip": {"image_token_index": SPARE_TOKEN},
    "instructblipvideo": {"video_token_index": SPARE_TOKEN},
    **dict.fromkeys(("minicpm_ocr", "minicpmv4_6", "minicpmv4_7", "nemotron_h_omni"),
                    {"image_token_id": SPARE_TOKEN}),
    # The thinker's 3-D positions find each image by the token after a vision-start
    # token, which its config does not name by default.
    "qwen2_5_omni_thinker": {"vision_start_token_id": SPARE_TOKEN, "vision_end_token_id": SPARE_TOKEN + 1},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": SPARE_TOKEN, "vision_end_token_id": SPARE_TOKEN + 1},
    # -- vision-language: widths and geometry the recipe cannot derive.
    # Images and audio become vocabulary tokens: the image codebook's range ends where the
    # audio one's begins, both inside the (tiny) vocabulary. The audio tokenizer has no
    # projection around its quantizer: its codebook is as wide as its hidden size.
    "apertus1p5": {"image_token_offset": 64, "audio_token_offset": 80,
                   "vision_config": {"codebook_size": 16, "base_channels": 32, "num_res_blocks": 1,
                                     "resolution": IMAGE},
                   "audio_config": {"codebook_dim": HIDDEN, "codebook_size": 16}},
    # Its projector maps a patch count to a query count (the real ones: 35x35 and 70x70
    # patches); the tiny image is 4x4 patches.
    "aria": {"projector_patch_to_query_dict": {16: 4}, "max_value_projector_patch_to_query_dict": 4},
    # MLA: the sliding layers' head is the no-RoPE part plus the RoPE part.
    "dots3_note": {"text_config": {"head_dim": 2 * HEAD_DIM}},
    # Its rotary layout stacks the height and width sections: they must be equal.
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}}},
    # Pixel shuffle by 0.5 makes each vision feature 4x the tower's width, the adapter
    # MLP's input (named intermediate_size); the projector takes vision_output_dim.
    "llama4": {"vision_config": {"intermediate_size": 4 * HIDDEN, "vision_output_dim": HIDDEN}},
    # Its rotary part is head_dim x partial_rotary_factor (0.5), which must be qk_rope_head_dim.
    "mistral4": {"head_dim": 2 * HEAD_DIM},
    # Its tower concatenates the last state with the intermediate layers' (one, tiny).
    "mllama": {"vision_config": {"vision_output_dim": 2 * HIDDEN}},
    # Its patch position table is as long as the real grid (27x27): the tiny one is 4x4.
    "molmo2": {"vision_config": {"num_position_embeddings": 16}},
    # out_hidden_size is the merged patch width (vision width x merge**2), not the text's.
    "muse_glimmer": {"out_hidden_size": 4 * HIDDEN},
    "muse_spark": {"out_hidden_size": 4 * HIDDEN},
    # One crop is the whole (tiny) image.
    "phi4_multimodal": {"vision_config": {"crop_size": IMAGE}},
    # Its text model builds a sliding-window mask whether or not a layer slides, and the
    # default leaves the window unset.
    "step3p7": {"text_config": {"sliding_window": 16}},
    # -- audio
    # Its adaptor's width is fixed at a quarter of the text width.
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},
    # Text and audio-codebook tokens share one embedding; the audio pad is its last row
    # (vocab + codebooks x codebook vocab), which the id map must not move.
    "kyutai_speech_to_text": {"num_codebooks": 4, "codebook_vocab_size": 16,
                              "audio_pad_token_id": VOCAB + 4 * 16},
    # Moonshine Streaming's decoder reads a key/value head count its config lacks.
    "moonshine_streaming": {"num_key_value_heads": HEADS},
    # Its audio projector's output feeds the text model.
    "qwen3_asr": {"audio_config": {"output_dim": HIDDEN}},
    # Qwen3-Omni's talker reads a shared expert width and a merge size its configs lack.
    "qwen3_omni_moe": {"talker_config": {"spatial_merge_size": 2, "text_config": {
        "shared_expert_intermediate_size": EXPERT_INTERMEDIATE}}},
    # No audio token by default (the tokenizer's); the features go there.
    "voxtral": {"audio_token_id": SPARE_TOKEN + 2},
}


def _token_key(key: str) -> bool:
    return key.endswith(("token_id", "token_index", "token_ids", "_patch_id"))


def _token_ids(config: Any) -> dict[int, int]:
    """Each special token id of ``config``'s tree that the tiny vocabulary cannot hold,
    mapped to its own id at the top of it: distinct ids stay distinct (an image token
    must not become the video token), equal ids stay equal across sub-configs."""
    found: set[int] = set()

    def walk(cfg: Any) -> None:
        for key, value in cfg.to_dict().items():
            if _token_key(key):
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
                        found.add(v)
        for _, sub in _nested(cfg):
            walk(sub)
    walk(config)
    return {old: VOCAB - 1 - i for i, old in enumerate(sorted(found))}


def _index_map(values: list[int], count: int) -> list[int]:
    """Layer numbers of a ``count``-layer stack mapped into ``LAYERS`` layers, keeping
    that some layers are not listed where the original left some out (Qwen2.5-VL's
    full-attention blocks among windowed ones)."""
    mapped = sorted({min(LAYERS - 1, v * LAYERS // max(count, 1)) for v in values if v >= 0})
    if len(mapped) == LAYERS and len(set(values)) < count:
        mapped = mapped[1:]
    return mapped


def _clip_feature_layer(value: Any) -> Any:
    def clip(v: int) -> int:
        return max(v, -LAYERS) if v < 0 else min(v, LAYERS - 1)
    if isinstance(value, list):
        return [clip(v) if isinstance(v, int) else v for v in value]
    return clip(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tower_overrides(defaults: dict[str, Any], ids: dict[int, int], count: int | None = None) -> dict[str, Any]:
    """The whole-model recipe's values for one config of the tree (``defaults``: its
    ``to_dict()``): `tiny_overrides`, less its causal-LM rule (``is_decoder``), plus the
    towers' fields. ``ids``: `_token_ids` of the whole tree; ``count``: the layer count
    the config's layer lists refer to where it has none of its own (a top-level config
    naming its vision tower's layers)."""
    out = tiny_overrides(defaults)
    if defaults.get("is_decoder") is False:
        out.pop("is_decoder", None)
    for key, value in defaults.items():
        if value == 0 and _is_int(value) and key in out:
            out.pop(key)  # a width of 0 switches a part off (GLM-5's NoPE attention): it stays off
    if defaults.get("num_key_value_heads") is not None and defaults.get("num_key_value_heads") == \
            defaults.get("num_attention_heads") and "num_key_value_heads" in out:
        # Multi-head attention stays so: some checkpoint formats fuse q, k and v into one
        # matrix split in three equal parts on load (Nemotron ASR encoders).
        out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
    own = _layer_count(defaults)
    if own is None and _is_int(defaults.get("depth")):
        own = defaults["depth"]
    for key, value in defaults.items():
        if _token_key(key):
            if _is_int(value) and value in ids:
                out[key] = ids[value]
            elif isinstance(value, list):
                out[key] = [ids.get(v, v) if _is_int(v) else v for v in value]
        elif key in _TOWER_LAYERS and _is_int(value):
            out[key] = min(value, LAYERS)
        elif key in _LAYER_INDEXES and isinstance(value, list) and all(_is_int(v) for v in value):
            out[key] = _index_map(value, own if own is not None else (count or LAYERS))
        elif key in _FEATURE_LAYERS:
            out[key] = _clip_feature_layer(value)
        elif key in _OTHER_HIDDEN and _is_int(value) and value > HIDDEN:
            out[key] = HIDDEN
        elif key == "image_size" and _is_int(value):
            out[key] = IMAGE
        elif key == "image_size" and isinstance(value, list) and len(value) == 2:
            out[key] = [IMAGE, IMAGE]
        elif key == "patch_size" and _is_int(value):
            out[key] = min(value, PATCH)
        elif key == "patch_size" and isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            out[key] = [min(value[0], PATCH)] * 2
        elif key in ("num_mel_bins", "input_feat_per_channel") and _is_int(value):
            out[key] = MEL_BINS
        elif key in ("unpadded_vocab_size", "vocab_size_per_layer_input") and _is_int(value):
            out[key] = VOCAB
        elif key == "image_grid_pinpoints" and isinstance(value, list):
            # LLaVA-NeXT's tilings, in multiples of the (tiny) tile size
            out[key] = [[IMAGE, IMAGE], [IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE]]
        elif key == "resampler_n_latents" and _is_int(value):
            out[key] = 4
        elif key in ("num_query_tokens", "latent_query_num") and _is_int(value):
            out[key] = 4  # the image's tokens in the text (BLIP-2's queries, Kosmos-2's latents)
        elif key == "mm_tokens_per_image" and _is_int(value):
            out[key] = (IMAGE // PATCH) ** 2 // 4  # pooled 2x2 from the tiny patch grid
        elif key == "max_source_positions" and _is_int(value):
            out[key] = SOURCE_POSITIONS
        elif key == "upsample_groups" and _is_int(value):
            out[key] = HIDDEN  # a depthwise upsampling over the hidden channels (Mimi)
        elif key == "downsample_channels" and isinstance(value, list):
            out[key] = [HIDDEN] * len(value)  # a SAM neck's widths; the last feeds a tower of HIDDEN
        elif key in _STAGE_DEPTHS and isinstance(value, list) and all(_is_int(v) for v in value):
            out[key] = [1] * len(value)
        elif _more_noise(key, value):
            out[key] = 0.0
    if defaults.get("sliding_window") is None and any("sliding" in str(t) for t in defaults.get("layer_types") or []):
        out["sliding_window"] = 16  # sliding layers need a window; the default leaves it to the checkpoint
    stages = next((defaults[k] for k in _STAGE_DEPTHS if isinstance(defaults.get(k), list)), None)
    if stages is not None:
        # A hierarchical tower (Swin, ConvNeXt): its lists give one entry per stage, not
        # per layer, so the stages stay and each gets one block (`_STAGE_DEPTHS`).
        for key, value in defaults.items():
            if isinstance(value, list) and len(value) == len(stages) and key not in _STAGE_DEPTHS:
                out.pop(key, None)
        for key in ("num_layers", "num_hidden_layers", "num_stages"):
            if defaults.get(key) == len(stages):
                out.pop(key, None)
        if "embed_dim" in out:  # stage widths follow the (tiny) embedding width: heads must divide them
            for key in ("num_heads", "num_attention_heads"):
                if isinstance(defaults.get(key), list) and len(defaults[key]) == len(stages):
                    out[key] = [HEADS] * len(stages)
    return out


def _more_noise(key: str, value: Any) -> bool:
    return isinstance(value, float) and value > 0 and (
        _noise_free(key, value) or any(word in key for word in _MORE_NOISE))


def _mrope_sections(defaults: dict[str, Any], out: dict[str, Any], rope: dict[str, Any]) -> list[int]:
    """Three multimodal-RoPE sections (time, height, width) that fill half the tiny
    rotary width, as the default's fill half the real one."""
    head = out.get("qk_rope_head_dim", defaults.get("qk_rope_head_dim")) or out.get("head_dim") or HIDDEN // HEADS
    factor = rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor")) or 1.0
    half = int(head * factor) // 2
    side = half * 3 // 8
    return [half - 2 * side, side, side]


def _with_mrope(defaults: dict[str, Any], out: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` with sections for the tiny width (flat, or one dict per layer
    type), or None where the config has none."""
    rope = defaults.get("rope_parameters")
    if not isinstance(rope, dict):
        return None
    if "rope_type" in rope or "rope_theta" in rope:
        return {**rope, "mrope_section": _mrope_sections(defaults, out, rope)}
    per_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
    if not per_type:
        return None
    return {**rope, **{k: {**v, "mrope_section": _mrope_sections(defaults, out, v)} for k, v in per_type.items()}}


def _uses_mrope(config: Any) -> bool:
    """A model whose text positions are 3-D (Qwen2-VL style): its vision tower merges
    patches spatially. Its rotary embedding falls back to sections sized for the real
    head width where the config names none, so the tiny config must."""
    return any("spatial_merge_size" in cfg.to_dict() or "mrope_section" in str(cfg.to_dict().get("rope_parameters"))
               for cfg in _tree(config))


def _tree(config: Any) -> list[Any]:
    return [config] + [c for _, sub in _nested(config) for c in _tree(sub)]


def _tiny_tree(config: Any, ids: dict[int, int], count: int | None, special: dict[str, Any],
               mrope: bool = False) -> dict[str, Any]:
    """`tower_overrides` of ``config`` with each sub-config as a whole tiny dict (its
    own sub-configs tiny too), ``special`` merged in at its depth; ``mrope``: the whole
    model uses multimodal RoPE (`_uses_mrope`)."""
    defaults = config.to_dict()
    out = tower_overrides(defaults, ids, count)
    # text configs only (a vision tower's own RoPE is 2-D)
    rope = _with_mrope(defaults, out) if mrope and "vocab_size" in defaults else None
    if rope is not None:
        out["rope_parameters"] = rope
    subs = _nested(config)
    # A top-level list of layer numbers refers to the vision tower's layers.
    vision = next((sub for name, sub in subs if "vision" in name), None)
    if vision is not None and count is None:
        vision_count = _layer_count(vision.to_dict()) or vision.to_dict().get("depth")
        out.update(tower_overrides(defaults, ids, vision_count if _is_int(vision_count) else None))
    for name, cls in (getattr(config, "sub_configs", None) or {}).items():
        if "vision" in name and getattr(config, name, None) is None and isinstance(cls, type):
            # No tower by default (Gemma 4): the tiny model gets one, or it would take no image.
            subs.append((name, cls()))
    for name, sub in subs:
        nested_special = special.get(name, {}) if isinstance(special.get(name), dict) else {}
        out[name] = {**sub.to_dict(), **_tiny_tree(sub, ids, None, nested_special, mrope)}
    names = {name for name, _ in subs}
    out.update({k: v for k, v in special.items() if k not in names})
    return out


def tiny_whole_config(model_type: str) -> Any:
    """The whole-model tiny config of ``model_type``: `tower_overrides` at every depth of
    the config tree, the sub-configs handed to the top-level constructor as dicts (so
    what it derives from them, such as PaliGemma's image token count, is derived from
    the tiny ones), `TOWER_SPECIAL`, and every source of training-mode noise zeroed."""
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    tree = _tiny_tree(defaults, _token_ids(defaults), None, TOWER_SPECIAL.get(model_type, {}),
                      _uses_mrope(defaults))
    config = transformers.AutoConfig.for_model(model_type, **tree)
    _zero_all_noise(config)
    return config


def _zero_all_noise(config: Any) -> None:
    """`_zero_noise` with `_MORE_NOISE`'s words too, at every depth."""
    for key, value in list(vars(config).items()):
        if _more_noise(key, value):
            setattr(config, key, 0.0)
    for _, sub in _nested(config):
        _zero_all_noise(sub)
