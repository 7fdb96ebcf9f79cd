"""A PEFT model is treated like the transformers model inside it, in one process: the
Plan takes the base model's ``_no_split_modules`` layers and counts what each trains,
`auto_wrap`'s training adjustments (`prepare_for_training`, given the Plan's
checkpointing as auto_wrap gives it) reach the base model without changing its config,
and `annot.save` asks which PEFT format to write."""

from __future__ import annotations

import json

import pytest
import torch

import annot
from annot.huggingface.model import prepare_for_training
from annot.module_state import peek_state
from annot.policies import Action
from tests.finetune.cases import lora_llama
from tests.huggingface.hf_archs import ARCHS

pytest.importorskip("peft")


def _layers(model) -> dict[str, torch.nn.Module]:
    """The modules of the classes the base model names in ``_no_split_modules``."""
    names = set(model.get_base_model()._no_split_modules)
    return {path: m for path, m in model.named_modules() if type(m).__name__ in names}


def test_the_plan_shards_and_checkpoints_the_base_models_no_split_layers_and_counts_trainable():
    model = lora_llama()
    layers = _layers(model)
    assert len(layers) == 2 and all(p.startswith("base_model.model.model.layers.") for p in layers)
    plan = annot.plan(model)
    assert plan.paths(Action.SHARD) == list(layers)
    assert plan.paths(Action.CHECKPOINT) == list(layers)
    table = plan.table().splitlines()
    assert "trainable" in table[1].split()
    for path, layer in layers.items():
        unit = plan.unit(path)
        assert "no_split_modules(LlamaDecoderLayer)" in unit.reason
        adapters = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        assert 0 < unit.trainable == adapters < unit.params
        (row,) = [line for line in table if f" {path} " in line]
        assert row.split()[4] == format(adapters)  # the trainable column
    assert plan.root.trainable == 0
    (root_row,) = [line for line in table if "(root)" in line]
    assert "frozen" in root_row.split()


def test_training_adjustments_reach_the_base_model_and_leave_its_config_alone(tmp_path):
    model = lora_llama()
    base = model.get_base_model()
    base.gradient_checkpointing_enable()
    config_before = base.config.to_json_string()
    plan = annot.plan(model)
    # auto_wrap's step 3: checkpointing whenever the Plan (or checkpoint=True) checkpoints.
    notes = prepare_for_training(model, checkpointing=bool(plan.paths(Action.CHECKPOINT)))
    assert any("turned off transformers' gradient checkpointing" in n for n in notes)
    assert not base.is_activation_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    state = peek_state(base)
    assert state is not None and state.no_cache_hook is not None  # on the base model
    ids = torch.randint(0, 128, (1, 6))
    assert model.train()(input_ids=ids).past_key_values is None
    with torch.no_grad():
        assert model.eval()(input_ids=ids).past_key_values is not None  # generation: cached
    assert base.config.to_json_string() == config_before
    assert base.config.use_cache is True
    base.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True


def test_saving_a_peft_model_asks_for_the_format(tmp_path):
    with pytest.raises(annot.CheckpointError,
                       match=r"^PeftModel is a PEFT model: pass peft='adapter' \(PEFT's "
                             r"adapter files, for PeftModel.from_pretrained\) or peft='merged'"):
        annot.save(lora_llama(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(annot.CheckpointError,
                       match=r"^peft='adapter', but LlamaForCausalLM is not a PEFT model"):
        annot.save(ARCHS["llama"].build(), tmp_path / "out", peft="adapter")
