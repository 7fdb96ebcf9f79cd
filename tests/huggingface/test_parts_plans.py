"""Plans of transformers and diffusers models made of parts (issue #42), on the meta
device: each part's role, towers as units (`Policy.towers`), the blocks
`_no_split_modules` forgets, the fallback for a model sharing one layer, and what a
frozen tower changes."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.policies import Policy
from annot.policies.roles import module_roles
from tests.huggingface.sweep_configs import tiny_config

transformers = pytest.importorskip("transformers")


def meta(model_type: str, cls: str, task: str) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(transformers, cls)(tiny_config(model_type, task=task))


@pytest.mark.parametrize(("model_type", "cls", "task", "roles"), [
    ("llava", "LlavaForConditionalGeneration", "image_text",
     {"model.vision_tower": "vision", "model.multi_modal_projector": "projector", "model.language_model": "language"}),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "image_text",
     {"model.visual": "vision", "model.language_model": "language"}),
    ("qwen2_audio", "Qwen2AudioForConditionalGeneration", "multimodal_lm",
     {"model.audio_tower": "audio", "model.multi_modal_projector": "projector", "model.language_model": "language"}),
    ("t5", "T5ForConditionalGeneration", "seq2seq", {"encoder": "encoder", "decoder": "decoder"}),
    ("whisper", "WhisperForConditionalGeneration", "speech_seq2seq",
     {"model.encoder": "encoder", "model.decoder": "decoder"}),
    ("bert", "BertForMaskedLM", "masked_lm", {}),  # one part: no role
    ("albert", "AlbertForMaskedLM", "masked_lm", {}),  # its head's Linear "decoder" is no decoder
])
def test_each_part_has_its_role(model_type, cls, task, roles):
    assert module_roles(meta(model_type, cls, task)) == roles


def test_the_default_plan_makes_the_tower_and_projector_units_and_shows_roles():
    model = meta("llava", "LlavaForConditionalGeneration", "image_text")
    plan = annot.plan(model)
    assert plan.unit("model.vision_tower").reason.endswith("(vision tower)")
    assert plan.unit("model.multi_modal_projector").role == "projector"
    assert all(u.role == "language" for u in plan.units if u.path.startswith("model.language_model."))
    header = plan.table().splitlines()[1].split()
    assert header[:3] == ["#", "unit", "role"]


def test_towers_whole_shards_each_tower_as_one_unit_and_keeps_its_blocks_checkpointed():
    model = meta("llava", "LlavaForConditionalGeneration", "image_text")
    plan = annot.plan(model, Policy.from_hf(towers="whole"))
    inside = [u for u in plan.units if u.path.startswith("model.vision_tower.")]
    assert inside and all(not u.has("shard") and u.has("checkpoint") for u in inside), plan.table()
    assert plan.unit("model.vision_tower").has("shard")


def test_a_frozen_tower_is_not_checkpointed_and_counts_as_frozen():
    model = meta("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "image_text")
    annot.freeze(model, "vision")
    plan = annot.plan(model)
    vision = [u for u in plan.units if u.role == "vision"]
    assert vision and all(u.trainable == 0 and not u.has("checkpoint") for u in vision)
    assert all(u.has("checkpoint") for u in plan.units if u.role == "language")
    assert "not checkpointed: the vision tower is frozen" in vision[0].reason


def test_blocks_no_split_modules_forgets_become_units():
    """Speech2Text's list names only its encoder's layer: the decoder's layers stayed in
    the root, gathered whole for the step."""
    plan = annot.plan(meta("speech_to_text", "Speech2TextForConditionalGeneration", "speech_seq2seq"))
    assert "model.decoder.layers.0" in plan.paths("shard"), plan.table()
    assert "not in _no_split_modules" in plan.unit("model.decoder.layers.0").reason


def test_a_listed_attention_makes_its_layer_the_unit_in_a_q_former():
    """BLIP-2 lists its Q-Former's attention, not its layer: the layer is the unit."""
    plan = annot.plan(meta("blip-2", "Blip2ForConditionalGeneration", "image_text"))
    assert plan.unit("qformer.encoder.layer.0").path == "qformer.encoder.layer.0"
    assert plan.unit("qformer.encoder.layer.0").role == "projector"


def test_a_model_sharing_one_layer_falls_back_to_its_list_elements():
    plan = annot.plan(meta("albert", "AlbertForMaskedLM", "masked_lm"))
    assert plan.paths("shard") == ["albert.encoder.albert_layer_groups.0"]
    assert any("list_elements" in w for w in plan.warnings)
