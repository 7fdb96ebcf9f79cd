"""`annot.from_pretrained` gives exactly the model transformers loads from the same files:
in one process (engine=None) for every architecture, and sharded on 2 ranks with FSDP2
(no rank holding any whole parameter) and with DeepSpeed ZeRO-3."""

from __future__ import annotations

import json
import types

import pytest
import torch

import annot
from annot.huggingface.pretrained import build_pretrained
from tests.huggingface.hf_archs import (
    ARCHS,
    PRETRAINED_DISTRIBUTED,
    TOLERANCE,
    buffer_variant,
    planted_sentinel,
    probe_inputs,
)


def transformers_logits(name: str, directory, **options) -> torch.Tensor:
    model = ARCHS[name].model_cls().from_pretrained(directory, **options)
    with torch.no_grad():
        return model(**probe_inputs(name)).logits


# The fast lane runs llama; the full suite every architecture.
@pytest.mark.parametrize("name", [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in ARCHS])
def test_logits_equal_transformers(saved_models, name):
    ours = annot.from_pretrained(saved_models[name], engine=None)
    assert type(ours).__name__ == ARCHS[name].model_class
    assert not ours.training  # like transformers' from_pretrained
    with torch.no_grad():
        logits = ours(**probe_inputs(name)).logits
    assert torch.equal(logits, transformers_logits(name, saved_models[name]))


def test_sharded_checkpoint_with_index(tmp_path):
    model = ARCHS["llama"].build()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = annot.from_pretrained(tmp_path, engine=None)
    with torch.no_grad():
        assert torch.equal(ours(**probe_inputs("llama")).logits, transformers_logits("llama", tmp_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_dtype_as_transformers(saved_models, dtype):
    """T5 in half precision: its ``wo`` stay fp32 in fp16 (``_keep_in_fp32_modules``),
    and the logits are transformers' own."""
    ours = annot.from_pretrained(saved_models["t5"], engine=None, torch_dtype=dtype)
    dtypes = {n: p.dtype for n, p in ours.named_parameters()}
    kept = {n for n in dtypes if ".wo." in n}
    assert kept and all(dtypes[n] == (torch.float32 if dtype == torch.float16 else dtype) for n in kept)
    assert all(dtypes[n] == dtype for n in dtypes if n not in kept)
    theirs = ARCHS["t5"].model_cls().from_pretrained(saved_models["t5"], dtype=dtype)
    assert {n: p.dtype for n, p in theirs.named_parameters()} == dtypes
    with torch.no_grad():
        assert torch.equal(ours(**probe_inputs("t5")).logits, theirs(**probe_inputs("t5")).logits)


def test_saved_architecture_is_the_default_class(saved_models):
    assert type(annot.from_pretrained(saved_models["bert"], engine=None)).__name__ == "BertForMaskedLM"


def test_architectures_absent_falls_back_to_auto_classes(saved_models, tmp_path):
    import shutil

    shutil.copytree(saved_models["gpt2"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.pop("architectures")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert type(annot.from_pretrained(tmp_path / "m", engine=None)).__name__ == "GPT2LMHeadModel"


def test_path_without_config_is_refused(tmp_path):
    with pytest.raises(annot.PretrainedPathError, match="no config.json"):
        annot.from_pretrained(tmp_path, engine=None)
    with pytest.raises(annot.PretrainedPathError, match="not a local directory"):
        annot.from_pretrained(tmp_path / "absent", engine=None)
    assert issubclass(annot.PretrainedPathError, annot.AnnotError)


@pytest.mark.parametrize("method", ["bitsandbytes", "fp8"])
def test_a_checkpoint_stored_quantized_is_refused_before_anything_is_read(saved_models, tmp_path, method):
    """A folder whose config carries a ``quantization_config`` (bitsandbytes' packed
    4-bit weights, FP8 blocks, ...): annot reads full-precision tensors, so it says so
    and points at quantize='nf4' instead of failing on the first packed weight's shape."""
    import shutil

    folder = tmp_path / "quantized"
    shutil.copytree(saved_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(annot.CheckpointError, match=f"already quantized \\({method}.*quantize='nf4'"):
        annot.from_pretrained(folder, engine=None)


def test_missing_weights_are_initialized_and_logged_or_refused_when_strict(
        saved_models, tmp_path, caplog):
    """A model with one more layer than the files: transformers initializes it and warns;
    so does annot, and ``strict=True`` refuses before allocating anything."""
    import shutil

    shutil.copytree(saved_models["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(annot.CheckpointError, match=r"missing \['model\.layers\.2\."):
        annot.from_pretrained(tmp_path / "m", engine=None, strict=True)
    with caplog.at_level("WARNING", logger="annot"):
        model = annot.from_pretrained(tmp_path / "m", engine=None)
    assert "model.layers.2." in caplog.text and "kept their initialization" in caplog.text
    assert not any(t.is_meta for t in model.state_dict().values())


def _built_on_meta_device(directory, **options) -> bool:
    from annot.meta.deferred import deferred_init_of

    record = deferred_init_of(build_pretrained(directory, **options))
    assert record is not None
    return record.on_meta_device


def test_the_build_is_on_the_meta_device_only_when_the_checkpoint_completes_it(saved_models, tmp_path):
    """Faster on the meta device, where transformers' init is skipped: kept when the files
    hold every persistent tensor and the tape computes the rest, else built again on fake
    tensors (docs/design.md, pitfall 29)."""
    import shutil

    import peft

    assert _built_on_meta_device(saved_models["llama"])
    assert _built_on_meta_device(saved_models["bert"])
    assert not _built_on_meta_device(saved_models["gemma"])  # embed_scale: a literal
    assert not _built_on_meta_device(saved_models["bert"], auto_class="AutoModel")  # a new pooler
    shutil.copytree(saved_models["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_hidden_layers"] = 3  # a layer the files lack
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert not _built_on_meta_device(tmp_path / "m")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"])
    assert not _built_on_meta_device(saved_models["llama"], peft_config=lora)  # new adapters


@pytest.mark.parametrize("name, on_meta_device", [("llama3_rope", True), ("phi3_longrope", False)])
def test_rescaled_rotary_variants_load_as_transformers(tmp_path, name, on_meta_device):
    """Llama 3's rotary rescaling is computed on the meta device; Phi-3's long-rope
    factors are a literal there, so that build is refused and made again on fake tensors.
    Either way the logits are transformers' own from the same files."""
    cls, config = buffer_variant(name)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    assert _built_on_meta_device(tmp_path) is on_meta_device
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = annot.from_pretrained(tmp_path, engine=None)(input_ids=tokens).logits
        theirs = cls.from_pretrained(tmp_path)(input_ids=tokens).logits
    assert torch.equal(ours, theirs)


def test_head_the_files_lack_is_initialized_as_transformers_does(saved_models):
    """A masked-LM checkpoint into the bare BertModel: the pooler is new (initialized), the
    MLM head is ignored; the encoder's weights are the files'."""
    ours = annot.from_pretrained(saved_models["bert"], engine=None, auto_class="AutoModel")
    theirs = ARCHS["bert"].model_cls().from_pretrained(saved_models["bert"]).bert
    assert type(ours).__name__ == "BertModel"
    for name, value in theirs.state_dict().items():
        if not name.startswith("pooler."):
            assert torch.equal(ours.state_dict()[name], value), name


def test_mapped_load_is_transformers_model_and_a_write_stays_in_the_process(saved_models):
    """engine=None, ``mmap=True``: the logits transformers gives; writing a weight changes
    the model only (copy-on-write), not the file nor a model loaded after."""
    directory = saved_models["llama"]
    ours = annot.from_pretrained(directory, engine=None, mmap=True)
    with torch.no_grad():
        assert torch.equal(ours(**probe_inputs("llama")).logits, transformers_logits("llama", directory))
        weight = ours.model.embed_tokens.weight
        expected = weight.clone()
        weight.add_(1.0)
    again = annot.from_pretrained(directory, engine=None, mmap=True)
    assert torch.equal(again.model.embed_tokens.weight, expected)


def test_mmap_maps_only_what_it_can_and_says_what_it_cannot(saved_models, monkeypatch):
    """The report counts mapped bytes; another dtype is read (converted); a model with
    storage, a distributed checkpoint, another device and flattening engines are
    refused with the reason, before anything changes."""
    directory = saved_models["llama"]
    model = build_pretrained(directory)
    report = annot.load(model, directory, mmap=True)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (report.bytes_mapped, report.bytes_read) == (size, 0)

    half = build_pretrained(directory, torch_dtype=torch.bfloat16)
    report = annot.load(half, directory, mmap=True)
    assert (report.bytes_mapped, report.bytes_read) == (0, size)  # the fp32 bytes, converted
    assert torch.equal(half.lm_head.weight, model.lm_head.weight.bfloat16())

    with pytest.raises(annot.CheckpointError, match="already has storage"):
        annot.load(model, directory, mmap=True)
    with pytest.raises(annot.CheckpointError, match="distributed checkpoint"):
        annot.load(build_pretrained(directory), directory,
                   mmap=True, dcp=True)
    # A GPU is named without one here: the device choice is stood in for, and the mmap
    # check refuses before anything touches the device.
    from annot import wrap

    chosen = wrap.choose_device
    monkeypatch.setattr(wrap, "choose_device", lambda device: torch.device(device) if
                        str(device).startswith("cuda") else chosen(device))
    for engine, device, why in (("fsdp1", "cpu", "flattened"), ("deepspeed", "cpu", "flattened"),
                                ("fsdp2", "cuda:0", "copied anyway")):
        with pytest.raises(annot.CheckpointError, match=why):
            annot.from_pretrained(directory, engine, mmap=True, device=device)
    # A model an engine sharded over an accelerator's mesh (there is none here: one
    # parameter carries such a mesh, as a DTensor would) is refused too.
    on_accelerator = build_pretrained(directory)
    next(on_accelerator.parameters()).device_mesh = types.SimpleNamespace(device_type="xpu")
    with pytest.raises(annot.CheckpointError, match="device mesh is on xpu"):
        annot.load(on_accelerator, directory, mmap=True)


def test_engine_none_takes_no_wrap_options(saved_models):
    with pytest.raises(ValueError, match="engine=None takes no auto_wrap options"):
        annot.from_pretrained(saved_models["llama"], engine=None, checkpoint=True)


def _check_distributed(result: dict, name: str, directory) -> None:
    """The loaded state is bitwise transformers'; the logits agree to float rounding
    (a sharded engine's forward may take other kernels: FSDP2's T5 differs by ~7e-7 with
    a bitwise-equal state, while the single-process test above asserts exact logits)."""
    assert "error" not in result, result.get("error")
    theirs = ARCHS[name].model_cls().from_pretrained(directory)
    expected = theirs.state_dict()
    assert set(result["state"]) == set(expected)
    assert [k for k, v in expected.items() if not torch.equal(result["state"][k], v)] == []
    with torch.no_grad():
        logits = theirs(**probe_inputs(name)).logits
    torch.testing.assert_close(result["logits"], logits, atol=TOLERANCE, rtol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("name", PRETRAINED_DISTRIBUTED)
def test_fsdp2_from_pretrained_on_two_ranks(fsdp2_run, saved_models, name):
    result = fsdp2_run["pretrained"][name]
    _check_distributed(result, name, saved_models[name])
    assert result["whole"] == [], "a rank holds these parameters whole"


@pytest.mark.distributed
@pytest.mark.parametrize("name", PRETRAINED_DISTRIBUTED)
def test_fsdp2_mapped_from_pretrained_is_the_same_model(fsdp2_run, saved_models, name):
    """``mmap=True``: the same state and logits, every rank's shards still its own rows;
    on llama (fp32 files, every shard even) every parameter lies in a map of the file."""
    result = fsdp2_run["mapped"][name]
    _check_distributed(result, name, saved_models[name])
    assert result["whole"] == []
    if name == "llama":
        assert result["not_mapped"] == []
    assert len(result["not_mapped"]) < len(result["state"])  # something was mapped


@pytest.mark.distributed
def test_training_a_mapped_model_is_bitwise_reading_and_never_writes_the_file(fsdp2_run):
    """3 SGD steps on 2 ranks after ``from_pretrained(..., mmap=True)`` and after reading:
    the same losses, every gradient and the final state bitwise (the steps write every
    mapped page: the copy-on-write), and the checkpoint's bytes unchanged."""
    run = fsdp2_run["mapped_training"]
    assert "error" not in run, run.get("error")
    read, mapped = run["read"], run["mapped"]
    assert torch.equal(torch.stack(mapped["losses"]), torch.stack(read["losses"]))
    for step, (ours, theirs) in enumerate(zip(mapped["grads"], read["grads"], strict=True)):
        assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == [], step
    assert [n for n in read["state"] if not torch.equal(mapped["state"][n], read["state"][n])] == []
    before, after = run["digests"]
    assert before == after


@pytest.mark.distributed
def test_zero3_from_pretrained_on_two_ranks(zero3_run, saved_models):
    _check_distributed(zero3_run["pretrained"]["llama"], "llama", saved_models["llama"])


@pytest.mark.distributed  # reads the 2-rank launch's results
def test_a_planted_metadata_pickle_never_runs(fsdp2_run, saved_models):
    """Every model folder of these tests holds a ``.metadata`` whose unpickling creates a
    file; after the 1-rank tests above and the 2-rank FSDP2 launch (all of which loaded
    the right values) the file does not exist (docs/design.md, pitfall 17)."""
    assert fsdp2_run  # the 2-rank from_pretrained runs happened
    assert not planted_sentinel(saved_models).exists()


def test_with_an_engine_every_module_is_in_training_mode(tmp_path, one_rank):
    # Emu3's VQ tokenizer sets itself to eval mode in its constructor; transformers'
    # from_pretrained then the trainer's model.train() leave it training, and in
    # training mode it gives other image tokens (the class sweep's loss was 1.4e-4 off).
    import transformers

    from tests.huggingface.sweep_configs import tiny_config

    transformers.Emu3ForConditionalGeneration._from_config(tiny_config("emu3", "image_text")).save_pretrained(tmp_path)
    model = annot.from_pretrained(tmp_path, "ddp", device="cpu")
    assert [name for name, module in model.named_modules() if not module.training] == []
