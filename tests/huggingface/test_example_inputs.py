"""`annot.huggingface.example_inputs.training_inputs` on a handful of families: the
placeholders match what the towers produce, each family's own inputs are there, a
fake copy of the model (the memory planner's trace) and a ``meta_init`` model get
batches of the same shapes, ``with_images=False`` gives text, and what cannot be
served is refused. Every architecture of the mappings: tests/huggingface/probe_classes.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from annot.huggingface.example_inputs import ExampleInputsError, training_inputs  # noqa: E402
from tests.huggingface.sweep_configs import tiny_config  # noqa: E402

# model type -> (tiny config task, class)
MODELS = {
    "qwen2_vl": ("image_text", "Qwen2VLForConditionalGeneration"),
    "llava": ("image_text", "LlavaForConditionalGeneration"),
    "idefics3": ("image_text", "Idefics3ForConditionalGeneration"),
    "mllama": ("image_text", "MllamaForConditionalGeneration"),
    "t5": ("seq2seq", "T5ForConditionalGeneration"),
    "whisper": ("speech_seq2seq", "WhisperForConditionalGeneration"),
    "bert": ("masked_lm", "BertForMaskedLM"),
    "vit": ("image_classification", "ViTForImageClassification"),
    "blip-2": ("image_text", "Blip2ForConditionalGeneration"),
    "instructblip": ("image_text", "InstructBlipForConditionalGeneration"),
    "instructblipvideo": ("image_text", "InstructBlipVideoForConditionalGeneration"),
}
SEQ = 48
_built: dict[str, torch.nn.Module] = {}


def build(model_type: str) -> torch.nn.Module:
    """The tiny model of ``model_type`` (fixed seed), built once per session."""
    import transformers

    if model_type not in _built:
        task, cls = MODELS[model_type]
        torch.manual_seed(0)
        _built[model_type] = getattr(transformers, cls)._from_config(tiny_config(model_type, task)).train()
    return _built[model_type]


def inputs(model: torch.nn.Module, **options: Any) -> dict[str, Any]:
    return training_inputs(model, batch=2, seq=SEQ, generator=torch.Generator().manual_seed(1), **options)


def shapes(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def image_tokens(model: torch.nn.Module, batch: dict[str, Any]) -> int:
    token = model.config.image_token_id
    return int((batch["input_ids"] == token).sum())


def test_llava_takes_as_many_image_tokens_as_its_tower_makes_features() -> None:
    model = build("llava")
    batch = inputs(model)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    assert image_tokens(model, batch) == sum(f.shape[0] for f in features)
    assert (batch["labels"][batch["input_ids"] == model.config.image_token_id] == -100).all()


def test_qwen2_vl_gets_flattened_patches_a_grid_and_token_types() -> None:
    model = build("qwen2_vl")
    vision = model.config.vision_config
    batch = inputs(model)
    side = 2 * vision.spatial_merge_size  # the default size: two merged tokens a side
    assert batch["image_grid_thw"].tolist() == [[1, side, side]] * 2
    assert batch["pixel_values"].shape == (
        2 * side * side, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
    assert image_tokens(model, batch) == 2 * side * side // vision.spatial_merge_size ** 2
    assert (batch["mm_token_type_ids"] == 1).sum() == image_tokens(model, batch)


def test_idefics3_gets_image_tiles_and_their_pixel_mask() -> None:
    model = build("idefics3")
    batch = inputs(model)
    size = model.config.vision_config.image_size
    assert batch["pixel_values"].shape == (2, 1, 3, size, size)
    assert batch["pixel_attention_mask"].shape == (2, 1, size, size)
    assert image_tokens(model, batch) == 2 * model.model.image_seq_len


def test_mllama_gets_aspect_ratios_and_a_cross_attention_mask() -> None:
    model = build("mllama")
    batch = inputs(model, images_per_sample=2)
    tiles = model.config.vision_config.max_num_tiles
    assert batch["aspect_ratio_ids"].tolist() == [[1, 1], [1, 1]]
    assert batch["aspect_ratio_mask"].shape == (2, 2, tiles)
    assert batch["cross_attention_mask"].shape == (2, SEQ, 2, tiles)
    assert image_tokens(model, batch) == 4  # one token per image


def test_t5_decoder_inputs_are_its_labels_shifted_behind_pad() -> None:
    """T5's config names no decoder_start_token_id (checkpoints do), so the shift that
    the model would do is done here, behind its pad token."""
    model = build("t5")
    batch = inputs(model)
    assert batch["labels"].shape == (2, SEQ) and batch["use_cache"] is False
    assert torch.equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    assert (batch["decoder_input_ids"][:, 0] == model.config.pad_token_id).all()


def test_whisper_gets_the_frames_its_encoder_insists_on() -> None:
    model = build("whisper")
    batch = inputs(model)
    config = model.config
    assert batch["input_features"].shape == (2, config.num_mel_bins, 2 * config.max_source_positions)


def test_bert_masked_lm_labels_ignore_most_positions() -> None:
    labels = inputs(build("bert"))["labels"]
    assert 0 < int((labels != -100).sum()) < labels.numel()


def test_vit_gets_images_and_one_class_each() -> None:
    model = build("vit")
    batch = inputs(model)
    size = model.config.image_size
    assert batch["pixel_values"].shape == (2, 3, size, size)
    assert batch["labels"].shape == (2,) and int(batch["labels"].max()) < model.config.num_labels


def test_equal_generators_give_equal_batches() -> None:
    model = build("llava")
    first, second = inputs(model), inputs(model)
    assert all(torch.equal(first[k], second[k]) for k in first if isinstance(first[k], torch.Tensor))


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_text_only_batch_has_no_images(model_type: str) -> None:
    model = build(model_type)
    batch = inputs(model, with_images=False)
    assert "pixel_values" not in batch and image_tokens(model, batch) == 0
    assert batch["input_ids"].shape == (2, SEQ)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava", "idefics3", "mllama", "whisper", "vit"])
def test_fake_parameters_get_the_same_batch(model_type: str) -> None:
    """As the memory planner traces: a copy holding fake parameters, called inside its
    FakeTensorMode (LLaVA's tower runs fake; the others count from their grid)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from annot.memory.activations import fake_copy

    model = build(model_type)
    real = inputs(model)
    copy, mode = fake_copy(model, None)
    with mode:
        fake = inputs(copy)
    assert shapes(fake) == shapes(real)
    assert all(isinstance(v, FakeTensor) for v in fake.values() if isinstance(v, torch.Tensor))


def test_meta_init_model_gets_the_same_shapes() -> None:
    import transformers

    import annot

    real = inputs(build("llava"))
    task, cls = MODELS["llava"]
    with annot.meta_init():
        model = getattr(transformers, cls)._from_config(tiny_config("llava", task))
    batch = inputs(model)
    assert shapes(batch) == shapes(real)
    assert batch["pixel_values"].device.type == "meta"


@pytest.mark.parametrize(("model_type", "token", "frames"), [
    ("blip-2", "image_token_id", 1), ("instructblip", "image_token_id", 1),
    ("instructblipvideo", "video_token_id", 4)])
def test_a_q_former_model_built_on_the_meta_device_gets_the_batch_of_a_real_one(
        model_type: str, token: str, frames: int) -> None:
    """The memory planner's build holds no values and the Q-Former's attention mask reads
    one (``.item()``): the count is the query tokens (each frame's), as a real run gives."""
    import transformers

    model = build(model_type)
    real = inputs(model)
    assert int((real["input_ids"] == getattr(model.config, token)).sum()) == 2 * frames * model.config.num_query_tokens
    task, cls = MODELS[model_type]
    with torch.device("meta"):
        empty = getattr(transformers, cls)._from_config(tiny_config(model_type, task))
    assert shapes(inputs(empty)) == shapes(real)


def test_a_module_without_a_transformers_config_is_refused() -> None:
    with pytest.raises(ExampleInputsError, match="Linear has no transformers config"):
        training_inputs(torch.nn.Linear(2, 2), batch=1, seq=4)


def test_a_sequence_too_short_for_the_images_is_refused() -> None:
    with pytest.raises(ExampleInputsError, match=r"LlavaForConditionalGeneration: .* need seq > \d+, got seq=4"):
        training_inputs(build("llava"), batch=1, seq=4)


def test_a_text_only_batch_for_a_speech_encoder_is_refused() -> None:
    with pytest.raises(ExampleInputsError, match="WhisperForConditionalGeneration takes its images or audio "
                                                 "in every batch.*its encoder reads only audio"):
        inputs(build("whisper"), with_images=False)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_the_batch_trains(model_type: str) -> None:
    """One training step on each family's batch gives a finite loss and gradients."""
    model = build(model_type)
    model.zero_grad(set_to_none=True)
    loss = model(**inputs(model)).loss
    loss.backward()
    assert math.isfinite(loss.item())
    assert any(p.grad is not None for p in model.parameters())
