"""What `auto_wrap` changes on a PreTrainedModel before checkpointing it
(`annot.huggingface.pretrained.prepare_for_training`): transformers' own checkpointing off when annot
checkpoints, kept when annot does not, and ``use_cache`` off on every config whenever
anything checkpoints (T5's stacks keep configs of their own)."""

from __future__ import annotations

import torch

from annot.huggingface.pretrained import _configs, is_pretrained_model, prepare_for_training
from tests.huggingface.hf_archs import ARCHS


def _hf_checkpointing(model) -> bool:
    return model.is_activation_checkpointing


def test_theirs_is_turned_off_when_annot_checkpoints(caplog):
    model = ARCHS["llama"].build()
    model.gradient_checkpointing_enable()
    assert _hf_checkpointing(model)
    with caplog.at_level("WARNING", logger="annot.huggingface.pretrained"):
        notes = prepare_for_training(model, checkpointing=True)
    assert not _hf_checkpointing(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert any("turned off transformers' gradient checkpointing" in n for n in notes)
    assert "turned off transformers' gradient checkpointing" in caplog.text
    assert model.config.use_cache is False


def test_theirs_is_kept_when_annot_does_not_checkpoint():
    model = ARCHS["llama"].build()
    model.gradient_checkpointing_enable()
    notes = prepare_for_training(model, checkpointing=False)
    assert _hf_checkpointing(model)
    assert any("kept transformers' gradient checkpointing" in n for n in notes)
    assert model.config.use_cache is False


def test_nothing_changes_when_nothing_checkpoints():
    model = ARCHS["llama"].build()
    assert prepare_for_training(model, checkpointing=False) == []
    assert model.config.use_cache is True


def test_use_cache_off_in_every_config_t5_holds():
    model = ARCHS["t5"].build()
    configs = _configs(model)
    assert len(configs) >= 3  # the model's, the encoder's and the decoder's copies
    assert all(c.use_cache for c in configs if c.is_decoder or c is model.config)
    prepare_for_training(model, checkpointing=True)
    assert all(c.use_cache is False for c in configs if hasattr(c, "use_cache"))
    assert model.decoder.config.use_cache is False


def test_pretrained_models_are_recognised_without_importing_transformers():
    assert is_pretrained_model(ARCHS["gpt2"].build())
    assert not is_pretrained_model(torch.nn.Linear(2, 2))
