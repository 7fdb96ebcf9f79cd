"""The memory trace of models that take more than tokens (issue #42), counted against a
real CPU step: vision-language models fed images and their tokens, diffusion
transformers fed noisy latents with a flow-matching loss (`annot.memory.inputs`), a
frozen tower priced without gradients, and what `annot plan --memory` says it fed."""

from __future__ import annotations

import pytest
import torch

from annot.memory.activations import _torch_linear, trace_step
from annot.memory.counting import LiveBytes
from annot.memory.engine_memory import model_facts
from annot.memory.inputs import step_inputs
from annot.policies import make_plan

TOLERANCE = 0.05  # issue #42's bound; the cases below are within 0.1% (measured)

pytest.importorskip("transformers")


def _real_peak(model: torch.nn.Module, batch: int, seq: int) -> int:
    """Live bytes at the peak of one real CPU training step of ``model`` on the inputs
    the trace builds for it (parameters and buffers not counted, as the trace does)."""
    counter = LiveBytes()
    for kept in (*model.parameters(), *model.buffers()):
        counter.exclude(kept)
    model.train()
    with _torch_linear(), counter:
        args, kwargs, loss_of = step_inputs(None, model, batch, seq)
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return counter.peak


def _meta_twin(model: torch.nn.Module, build) -> torch.nn.Module:
    with torch.device("meta"):
        twin = build()
    for (_, mine), (_, theirs) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        theirs.requires_grad_(mine.requires_grad)
    return twin


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava_onevision"])
def test_a_vision_language_model_traces_its_images_as_a_real_step_counts(model_type):
    from tests.huggingface.multimodal_models import build

    model = build(model_type)
    meta = _meta_twin(model, lambda: type(model)(model.config))
    trace = trace_step(meta, make_plan(meta), batch=1, seq=48, checkpoint=False)
    real = _real_peak(model, 1, 48)
    assert abs(trace.peak_with_grads - real) <= TOLERANCE * real, (trace.peak_with_grads, real)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_a_diffusion_transformer_traces_its_flow_matching_step_as_a_real_step_counts(name):
    pytest.importorskip("diffusers")
    from tests.huggingface.diffusers_models import build

    model = build(name)
    meta = _meta_twin(model, lambda: type(model).from_config(model.config))
    trace = trace_step(meta, make_plan(meta), batch=2, seq=1, checkpoint=False)
    real = _real_peak(model, 2, 1)
    assert abs(trace.peak_with_grads - real) <= TOLERANCE * real, (trace.peak_with_grads, real)


def test_a_frozen_tower_has_no_gradients_or_optimizer_states_in_the_engines_rows():
    import annot
    from annot.memory.engine_memory import rank_memory
    from annot.memory.strategies import strategy
    from tests.huggingface.multimodal_models import build

    model = build("llava_onevision")
    with torch.device("meta"):
        meta = type(model)(model.config)
    plan = make_plan(meta)
    trace = trace_step(meta, plan, batch=1, seq=48, checkpoint=False)
    whole = model_facts(meta, plan)
    tower = sum(p.numel() for p in meta.model.vision_tower.parameters())
    annot.freeze(meta, "vision")
    frozen = model_facts(meta, make_plan(meta))
    assert whole.trainable is None and frozen.trained == whole.params - tower
    for key in ("ddp", "fsdp2", "zero3"):
        before = rank_memory(strategy(key), trace, whole, world=2, precision="bf16-mixed", optimizer="adamw")
        after = rank_memory(strategy(key), trace, frozen, world=2, precision="bf16-mixed", optimizer="adamw")
        # AdamW's two fp32 states at least (and gradients, master copies) of the tower go
        assert before.device - after.device >= tower * 8 // 2, key


def test_plan_memory_of_a_vision_language_folder_says_what_it_fed(tmp_path, capsys):
    from annot.cli.main import main
    from tests.huggingface.multimodal_models import build

    build("qwen2_5_vl").save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--memory", "--seq", "48", "--image-size", "32", "--images", "2"]) == 0
    out = capsys.readouterr().out
    assert "inputs: traced on 1 sample(s) of 48 tokens, 2 image(s) of 32 px each" in out
