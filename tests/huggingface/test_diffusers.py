"""diffusers models through annot (issue #42): model and pipeline folders read with
diffusers' file names and dtypes (`annot.formats.diffusers`,
`annot.huggingface.diffusers_model`), bitwise as diffusers' own ``from_pretrained``;
`annot.save` writes diffusers' layout back; Flux, SD3 and Wan (float32, and Wan in
bfloat16 with the tensors diffusers keeps in float32: docs/design.md, pitfall 57) train
on 2 CPU ranks with FSDP2 like one process, flow matching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import annot
from annot.errors import CheckpointError
from tests.distributed import torchrun
from tests.huggingface.diffusers_models import (
    DENOISERS,
    build,
    compare,
    loaded,
    reference,
    save_pipeline,
)

pytest.importorskip("diffusers")

WORKER = Path(__file__).with_name("diffusers_worker.py")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {name: save_pipeline(name, root / name) for name in DENOISERS}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(DENOISERS))
def test_from_pretrained_of_a_pipeline_is_diffusers_own_load_bitwise(pipelines, name):
    ours = annot.from_pretrained(pipelines[name], engine=None, torch_dtype=DENOISERS[name][1])
    theirs = loaded(name, pipelines[name])
    mine, expected = _state(ours), _state(theirs)
    assert mine.keys() == expected.keys()
    for key, value in expected.items():
        assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), key
    assert ours.training is False  # engine=None returns the model in eval mode, as diffusers


def test_wan_in_bf16_keeps_diffusers_float32_tensors_and_plans_one_dtype_per_unit(pipelines):
    model = annot.from_pretrained(pipelines["wan_bf16"], engine=None, torch_dtype=torch.bfloat16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert "scale_shift_table" in kept and "blocks.0.scale_shift_table" in kept
    assert any(".norm2." in n for n in kept) and any("time_embedder" in n for n in kept)
    plan = annot.plan(model)
    assert plan.mixed_dtype_units() == [], plan.table()
    assert plan.root_role == "denoiser"


def test_save_writes_diffusers_layout_that_diffusers_loads_bitwise(pipelines, tmp_path):
    model = annot.from_pretrained(pipelines["flux"], engine=None)
    files = annot.save(model, tmp_path / "one")
    assert [f.name for f in files] == ["diffusion_pytorch_model.safetensors"]
    assert json.loads((tmp_path / "one" / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    sharded = annot.save(model, tmp_path / "sharded", max_shard_bytes=100_000)
    assert len(sharded) > 1 and all(f.name.startswith("diffusion_pytorch_model-") for f in sharded)
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    for folder in ("one", "sharded"):
        back = type(model).from_pretrained(tmp_path / folder)
        for key, value in _state(model).items():
            assert torch.equal(_state(back)[key], value), (folder, key)


def test_a_component_is_chosen_by_name_and_an_unknown_one_is_refused(pipelines, tmp_path):
    pipeline = pipelines["flux"]
    assert type(annot.from_pretrained(pipeline, engine=None, component="transformer")).__name__ == \
        "FluxTransformer2DModel"
    with pytest.raises(annot.PretrainedPathError, match="has no component 'unet'.*transformer"):
        annot.from_pretrained(pipeline, engine=None, component="unet")
    with pytest.raises(annot.PretrainedPathError, match="not a diffusers pipeline folder"):
        annot.from_pretrained(pipeline / "transformer", engine=None, component="unet")


def test_a_config_naming_no_diffusers_class_is_refused_in_annots_words(tmp_path):
    build("flux").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "_class_name": "NoSuchTransformer"}))
    with pytest.raises(CheckpointError, match="has no model class 'NoSuchTransformer'"):
        annot.from_pretrained(tmp_path, engine=None)


@pytest.fixture(scope="module")
def two_ranks(pipelines, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("diffusers-run") / "results.pt"
    root = next(iter(pipelines.values())).parent
    cases = [f"{name}:{scenario}" for name in DENOISERS for scenario in ("plain", "checkpoint")]
    torchrun(WORKER, str(out), str(root), *cases, "flux:save", "flux:components", timeout=600)
    return torch.load(out, weights_only=False)


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["plain", "checkpoint"])
@pytest.mark.parametrize("name", list(DENOISERS))
def test_fsdp2_flow_matching_step_equals_one_process(pipelines, two_ranks, name, scenario):
    assert compare(name, reference(name, pipelines[name]), two_ranks[f"{name}:{scenario}"]) == []


@pytest.mark.distributed
def test_a_two_rank_save_loads_in_diffusers_bitwise(pipelines, two_ranks):
    saved = pipelines["flux"] / "saved"
    assert (saved / "diffusion_pytorch_model.safetensors").is_file()
    theirs = loaded("flux", pipelines["flux"])
    back = type(theirs).from_pretrained(saved)
    for key, value in _state(theirs).items():
        assert torch.equal(_state(back)[key], value), key


@pytest.mark.distributed
def test_frozen_vae_and_text_encoder_load_sharded_for_the_forward_only(two_ranks):
    """``component=`` of a pipeline, ``freeze="all"``: the VAE's ``encode`` and ``decode``
    (methods, not ``forward``: FSDP2 gathers the root for them too) and the CLIP text
    encoder give the libraries' own loads' outputs on each rank, nothing trains."""
    for rank in two_ranks["flux:components"]:
        assert rank == {"vae_encode": True, "vae_decode": True, "text_encoder": True, "trainable": 0}
