"""Reformer's reversible layers compute with their parameters during backward, outside
their forward hooks: FSDP2, FSDP1 and ZeRO-3 are refused by name before the model
changes (it crashed inside FSDP2: "got mixed torch.Tensor and DTensor", issue #42)."""

from __future__ import annotations

import pytest
import torch

import annot

transformers = pytest.importorskip("transformers")


def _reformer() -> torch.nn.Module:
    config = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, attention_head_size=8, num_attention_heads=4, feed_forward_size=64,
        axial_pos_embds_dim=(16, 16), axial_pos_shape=(4, 4), max_position_embeddings=16,
        attn_layers=["local", "local"], is_decoder=True, local_attn_chunk_length=4)
    with annot.meta_init():
        return transformers.ReformerModelWithLMHead(config)


@pytest.mark.parametrize("engine, options", [("fsdp2", {}), ("fsdp1", {}), ("deepspeed", {"stage": 3})])
def test_sharding_a_model_whose_layers_compute_outside_forward_is_refused_by_name(engine, options):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    model = _reformer()
    before = [type(m) for m in model.modules()]
    with pytest.raises(annot.EngineNotAvailableError, match="ReformerLayer: its reversible residual layers"):
        annot.auto_wrap(model, engine, **options)
    assert [type(m) for m in model.modules()] == before  # refused before anything changed
