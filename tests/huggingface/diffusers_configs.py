"""Tiny configs for every transformer (denoiser) model class of the installed diffusers
(the probe, tests/huggingface/probe_denoisers.py, and tests/huggingface/test_denoiser_inputs.py).

One generic recipe first: start from the class's ``__init__`` defaults (a diffusers
config is its ``__init__`` arguments) and shrink every size field the signature has:
2 blocks of each kind, 2 heads of width 16, hidden and text widths 32, feed-forward 64,
rotary axes rescaled to the new head width, latent channels a quarter where they all
divide evenly, every dropout 0 (training mode must be
deterministic: the probe compares two training steps bitwise). A field the signature
lacks is never added. Then ``SPECIAL``: one entry per class whose own rules the recipe
cannot meet, each with the reason.
"""

from __future__ import annotations

import inspect
from typing import Any

LAYERS = 2
HEADS = 2
HEAD_DIM = 16
HIDDEN = HEADS * HEAD_DIM
TEXT = 32  # every text/condition width: equal to HIDDEN, so a class that mixes them up still runs
FFN = 64
TIME = 32  # sinusoidal timestep features and time-embedding widths

# field -> tiny value, set only where the default is an int larger than the tiny value
# (a default of 0 or 1 blocks, or None for "derived", stays as the class has it).
_SIZES: dict[str, int] = {
    **dict.fromkeys(("num_layers", "num_single_layers", "num_mmdit_layers", "num_single_dit_layers",
                     "n_layers", "depth", "num_hidden_layers", "nlayers", "dit_depth", "num_visual_blocks",
                     "mmdit_layers", "num_text_layers", "num_refiner_layers", "n_refiner_layers",
                     "num_text_blocks", "num_layerwise_text_blocks", "num_refiner_text_blocks",
                     "perceiver_num_layers", "LFE_depth", "approximator_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_heads", "num_heads", "nheads", "dit_heads",
                     "text_num_attention_heads", "num_cross_attention_heads", "audio_num_attention_heads",
                     "cross_attn_num_heads", "LFE_num_heads", "face_encoder_num_heads"), HEADS),
    **dict.fromkeys(("attention_head_dim", "head_dim", "cross_attention_head_dim", "audio_attention_head_dim",
                     "cross_attn_dim_head", "LFE_dim_head", "d_kv", "linear_head_dim"), HEAD_DIM),
    **dict.fromkeys(("hidden_size", "dim", "model_dim", "token_dim", "embed_dim", "dit_dim", "d_model",
                     "embedding_dim", "caption_projection_dim"), HIDDEN),
    **dict.fromkeys(("joint_attention_dim", "text_dim", "caption_channels", "text_embed_dim",
                     "cross_attention_dim", "cross_attention_dim_t5", "cap_feat_dim", "context_in_dim",
                     "text_in_dim", "text_hidden_dim", "in_text_dim", "in_text_dim2", "pooled_projection_dim",
                     "text_emb_dim", "dit_text_dim", "cond_token_dim", "global_cond_dim",
                     "cross_attention_input_dim", "global_states_input_dim", "llm_features_dim",
                     "text_encoder_dim", "text_embed_2_dim", "image_embed_dim", "image_dim",
                     "encoder_hidden_states_channels", "crossattn_proj_in_channels",
                     "audio_cross_attention_dim", "text_embed_dim_t5", "image_proj_dim", "LFE_output_dim",
                     "LFE_id_dim", "LFE_vit_dim", "face_encoder_hidden_dim", "condition_dim"), TEXT),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "ff_dim", "ffn_hidden_size", "ff_inner_dim", "d_ff",
                     "text_intermediate_size", "moe_intermediate_dim", "approximator_hidden_dim",
                     "time_embed_hidden_dim"), FFN),
    **dict.fromkeys(("time_embed_dim", "freq_dim", "timestep_guidance_channels", "timestep_channels",
                     "timestep_embed_dim", "t_emb_dim", "time_proj_dim", "time_step_dim",
                     "timestep_features_dim", "fourier_embedding_dim", "time_dim", "adaln_dim", "dim_cond",
                     "adaln_lora_dim", "approximator_num_channels"), TIME),
    **dict.fromkeys(("num_experts", "num_routed_experts"), 4),
    **dict.fromkeys(("multiple_of",), 16),
    **dict.fromkeys(("vocab_size",), 128),
    # position tables sized for the probe's latents (a 16x16 grid at most)
    **dict.fromkeys(("sample_size", "pos_embed_max_size"), 16),
}
# Key/value head counts: 1 where the class groups queries (fewer kv heads than heads by
# default), HEADS where it pairs them one to one.
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "text_num_key_value_heads",
             "num_key_value_attention_heads")
_HEAD_COUNT = ("num_attention_heads", "n_heads", "num_heads", "text_num_attention_heads")
# Latent channel widths. They are tied to each other (packing 2x2 patches makes 4x the
# latent channels; conditioned models add condition latents and mask channels), so they
# shrink together by one factor, and only where every one of them divides by 16: a
# width with an odd part (16 + 16 + 1 mask channel) stays as the class has it.
_CHANNELS = ("in_channels", "out_channels", "audio_in_channels", "audio_out_channels", "io_channels",
             "in_visual_dim", "out_visual_dim", "latent_channel", "patch_latent_dim", "latent_dim",
             "audio_acoustic_hidden_dim", "cond_in_channels", "vace_in_channels", "latent_channels")
CHANNEL_SHRINK = 4
# Rotary axes: per-axis widths summing to the head width; rescaled to HEAD_DIM.
_ROPE_AXES = ("axes_dims_rope", "axes_dim_rope", "axes_dims", "rope_axes_dim", "rope_dim_list", "rope_dim")


def _defaults(cls: type) -> dict[str, Any]:
    """The class's default config: its ``__init__`` keyword defaults."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p.default for p in params
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not inspect.Parameter.empty}


def rescale_axes(axes: tuple[int, ...] | list[int], width: int) -> list[int]:
    """Even per-axis rotary widths in the proportions of ``axes`` that sum to ``width``
    (each axis keeps at least 2: a rotary axis rotates pairs)."""
    pairs = width // 2
    total = sum(axes)
    out = [max(1, round(a * pairs / total)) for a in axes]
    while sum(out) > pairs:  # rounding overshoot: take from the widest axis
        out[out.index(max(out))] -= 1
    out[0] += pairs - sum(out)  # undershoot: the first axis (time, or the text axis) absorbs it
    return [2 * p for p in out]


def tiny_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The config values that shrink ``defaults`` (a class's ``__init__`` defaults)."""
    out: dict[str, Any] = {}
    heads_default = next((defaults[k] for k in _HEAD_COUNT if isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if isinstance(value, bool):
            continue
        if key in _SIZES and isinstance(value, int) and value > _SIZES[key]:
            out[key] = _SIZES[key]
        elif key in _KV_HEADS and isinstance(value, int):
            out[key] = HEADS if value == heads_default else 1
        elif key in _ROPE_AXES and isinstance(value, (tuple, list)) and value and sum(value) > HEAD_DIM:
            out[key] = rescale_axes(value, HEAD_DIM)
        elif isinstance(value, float) and value > 0 and "dropout" in key.lower():
            out[key] = 0.0
    channels = {k: v for k, v in defaults.items() if k in _CHANNELS and isinstance(v, int) and not isinstance(v, bool)}
    if channels and all(v % 16 == 0 for v in channels.values()):
        out.update({k: v // CHANNEL_SHRINK for k, v in channels.items()})
    return out


# The continuous-input spatial transformers (UNet blocks): channels must split into the
# GroupNorm's groups.
_SPATIAL = {"in_channels": 16, "norm_num_groups": 8}

# One entry per class the recipe alone cannot build or run; each names its reason.
SPECIAL: dict[str, dict[str, Any]] = {
    # Defaults of None: no input layout at all until a checkpoint's config sets one.
    "Transformer2DModel": {**_SPATIAL, "cross_attention_dim": TEXT},
    "DreamLiteTransformer2DModel": {**_SPATIAL, "cross_attention_dim": TEXT},
    "TransformerTemporalModel": _SPATIAL,
    "EasyAnimateTransformer3DModel": {"in_channels": 16, "out_channels": 16, "patch_size": 2},
    # Latte-1's layout: learned variance (out = 2 x in), PixArt-style caption projection
    # to the inner width, adaLN-single; one temporal position per frame of video_length.
    "LatteTransformer3DModel": {"in_channels": 4, "out_channels": 8, "patch_size": 2, "caption_channels": TEXT,
                                "cross_attention_dim": HIDDEN, "norm_type": "ada_norm_single",
                                "num_embeds_ada_norm": 1000, "video_length": 2},
    # PixArt-alpha/sigma checkpoints project T5 features (caption_channels) to the width.
    "PixArtTransformer2DModel": {"caption_channels": TEXT},
    # HiDream: T5 and Llama widths, and one tapped Llama layer per block (double + single).
    # Its default rotary axes (32, 32) are two for its three id axes; the checkpoints' are
    # (64, 32, 32).
    "HiDreamImageTransformer2DModel": {"patch_size": 2, "caption_channels": [TEXT, TEXT],
                                       "llama_layers": list(range(2 * LAYERS)),
                                       "axes_dims_rope": rescale_axes((64, 32, 32), HEAD_DIM)},
    # Multi-axis rotary sections: a quarter of the head width (24 + 20 + 20 of 256).
    "Ideogram4Transformer2DModel": {"mrope_section": [2, 1, 1]},
    # Rotary widths inside the head: 2 x 3 x rope_freq_dim channels (96 of 128) and the
    # partial rotary_dim (32 of 64).
    "MiniMaxH3Transformer3DModel": {"rope_freq_dim": 2},
    "MiniMaxMusic3Transformer1DModel": {"rotary_dim": 8},
    # Phi-3's "su" rotary scaling, one factor per rotary frequency (head width / 2); None
    # is no valid value for it.
    "OmniGenTransformer2DModel": {"pad_token_id": 0, "rope_scaling": {"type": "su", "short_factor": [1.0] * (
        HEAD_DIM // 2), "long_factor": [1.0] * (HEAD_DIM // 2)}},
    # FramePack's checkpoints: the image projection and the clean-latents embedder the
    # forward calls unconditionally.
    "HunyuanVideoFramepackTransformer3DModel": {"has_image_proj": True, "has_clean_x_embedder": True},
    # The face motion encoder sized down: 16 x 16 face crops, narrow convolutions; a face
    # adapter every 2 blocks (every 5 of 40), so the 2 blocks keep one.
    "WanAnimateTransformer3DModel": {"inject_face_latents_blocks": 2, "motion_encoder_size": 16, "motion_encoder_channel_sizes": {
        "4": 16, "8": 16, "16": 16}, "motion_style_dim": 16, "motion_dim": 4, "motion_encoder_dim": 16},
    # The pair stack's widths (a pair representation per residue pair): names only this
    # class uses.
    "RFD4ProteinaTransformer": {"pair_repr_dim": 16, "tri_mult_c": 16, "seq_sep_dim": 8, "token_type_emb_dim": 8,
                                "cath_emb_dim": 8},
    # A plain velocity checkpoint: the output has the latent's channels.
    "Kandinsky6SRTransformer3DModel": {"in_visual_dim": 4, "out_visual_dim": 4},
    # Its padding mask is resized with torchvision, which this environment lacks; the
    # mask adds one input channel, the rest of the model is the same.
    "CosmosTransformer3DModel": {"concat_padding_mask": False},
    # Fixed text lengths (CLIP 77, T5 256): the padding embedding and the T5 pooler's
    # positions are sized by them.
    "HunyuanDiT2DModel": {"in_channels": 4, "patch_size": 2, "text_len": 8, "text_len_t5": 8},
    "LuminaNextDiT2DModel": {"num_kv_heads": HEADS},
    "PRXTransformer2DModel": {"axes_dim": [HEAD_DIM // 2, HEAD_DIM // 2]},  # two axes summing to the head width
    "WanVACETransformer3DModel": {"vace_layers": [0, 1]},  # VACE blocks at existing layers
    # Text bundles injected at existing layers; gist token counts within the tiny text.
    "BriaFibo2Transformer2DModel": {"injection_layer_ids": [0, 1], "min_num_gist_tokens": 4,
                                    "max_num_gist_tokens": 8, "gist_step": 4, "gist_min_text_len": 4,
                                    "gist_max_text_len": 16},
    # out_channels defaults to in_channels, but the output is unpatched by patch_size:
    # 2x2 patches of 4 latent channels in (16), 4 channels x 2 x 2 out.
    "NucleusMoEImageTransformer2DModel": {"out_channels": 4},
}


def transformer_classes() -> dict[str, type]:
    """Every ``ModelMixin`` subclass defined under ``diffusers.models.transformers``, by name."""
    import importlib
    import pkgutil

    import diffusers.models.transformers as package
    from diffusers.models.modeling_utils import ModelMixin

    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, ModelMixin)
                    and value.__module__ == module.__name__):
                found[name] = value
    return dict(sorted(found.items()))


def tiny_denoiser_config(class_name: str) -> dict[str, Any]:
    """The tiny config (``__init__`` keyword arguments, for ``cls.from_config``) of the
    diffusers transformer class named ``class_name``."""
    cls = transformer_classes()[class_name]
    defaults = _defaults(cls)
    return {**defaults, **tiny_overrides(defaults), **SPECIAL.get(class_name, {})}
