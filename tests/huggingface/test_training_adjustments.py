"""What `auto_wrap` changes on a PreTrainedModel before checkpointing it
(`annot.huggingface.model.prepare_for_training`): transformers' own checkpointing off when
annot checkpoints, kept when annot does not, and training forwards without a key/value
cache whenever anything checkpoints, with every config left as the user had it (so saved
models and generation keep ``use_cache``)."""

from __future__ import annotations

import json

import torch

from annot.huggingface.model import is_pretrained_model, prepare_for_training
from tests.huggingface.hf_archs import ARCHS


def _hf_checkpointing(model) -> bool:
    return model.is_activation_checkpointing


def test_theirs_is_turned_off_when_annot_checkpoints(caplog):
    model = ARCHS["llama"].build()
    model.gradient_checkpointing_enable()
    assert _hf_checkpointing(model)
    with caplog.at_level("WARNING", logger="annot.huggingface"):
        notes = prepare_for_training(model, checkpointing=True)
    assert not _hf_checkpointing(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert any("turned off transformers' gradient checkpointing" in n for n in notes)
    assert "turned off transformers' gradient checkpointing" in caplog.text
    assert model.config.use_cache is True


def test_theirs_is_kept_when_annot_does_not_checkpoint():
    model = ARCHS["llama"].build()
    model.gradient_checkpointing_enable()
    notes = prepare_for_training(model, checkpointing=False)
    assert _hf_checkpointing(model)
    assert any("kept transformers' gradient checkpointing" in n for n in notes)
    assert model.config.use_cache is True


def test_nothing_changes_when_nothing_checkpoints():
    model = ARCHS["llama"].build()
    assert prepare_for_training(model, checkpointing=False) == []
    assert model.config.use_cache is True


def _use_cache_settings(model) -> list[tuple[str, object]]:
    """Every module's config's use_cache (T5's stacks hold configs of their own)."""
    return [(path, m.config.use_cache) for path, m in model.named_modules()
            if hasattr(getattr(m, "config", None), "use_cache")]


def _cache_of(model, train: bool, **kwargs):
    model.train(train)
    ids = torch.randint(0, 64, (1, 6))
    extra = {"decoder_input_ids": ids} if "t5" in type(model).__name__.lower() else {}
    return model(input_ids=ids, **extra, **kwargs).past_key_values


def test_training_forwards_run_without_a_cache_and_configs_stay_as_they_were(tmp_path):
    for name in ("llama", "t5"):  # T5's stacks keep configs of their own
        model = ARCHS[name].build()
        before = _use_cache_settings(model)
        assert _cache_of(model, train=True) is not None  # transformers' default: cached
        prepare_for_training(model, checkpointing=True)
        assert _cache_of(model, train=True) is None
        assert _cache_of(model, train=True, use_cache=True) is None  # refused, and logged
        with torch.no_grad():
            assert _cache_of(model, train=True) is not None  # no graph: nothing recomputes
        assert _cache_of(model, train=False) is not None  # eval and generation: the config's
        assert _use_cache_settings(model) == before
        model.save_pretrained(tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["use_cache"] is True


def test_the_cache_hook_is_installed_once():
    model = ARCHS["llama"].build()
    prepare_for_training(model, checkpointing=True)
    assert prepare_for_training(model, checkpointing=True) == []
    assert len(model._forward_pre_hooks) == 1


def test_pretrained_models_are_recognised_without_importing_transformers():
    assert is_pretrained_model(ARCHS["gpt2"].build())
    assert not is_pretrained_model(torch.nn.Linear(2, 2))
