"""annot.save / annot.load on one process: formats, strictness, dtypes, ties, HF interop."""

from __future__ import annotations

import json

import pytest
import torch

import annot
from examples.gpt.model import GPT

SHAPE = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, block_size=32)


def _trained_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(**SHAPE)


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert [k for k in sa if not torch.equal(sa[k].to(sb[k].dtype), sb[k])] == []


def test_round_trip_into_a_meta_init_model(tmp_path):
    source = _trained_gpt()
    annot.save(source, tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["model.safetensors"]
    with annot.meta_init():
        model = GPT(**SHAPE)
    report = annot.load(model, tmp_path / "ck")
    _assert_same_state(source, model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert report.missing == report.unexpected == ()
    # The tied weight is stored and read once.
    assert report.bytes_read == sum(p.numel() * 4 for p in source.parameters())
    # The non-persistent causal mask was recomputed, not loaded.
    assert torch.equal(model.transformer.h[0].attn.mask, source.transformer.h[0].attn.mask)


def test_sharded_files_with_an_index(tmp_path):
    source = _trained_gpt()
    files = annot.save(source, tmp_path / "ck", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and {f.name for f in files} == set(index["weight_map"].values())
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved under its first name
    model = _trained_gpt(seed=1)
    annot.load(model, tmp_path / "ck")
    _assert_same_state(source, model)


def test_a_single_file_path_and_dtype_conversion(tmp_path):
    source = _trained_gpt()
    annot.save(source, tmp_path / "ck", dtype=torch.bfloat16)
    model = _trained_gpt(seed=1)
    annot.load(model, tmp_path / "ck" / "model.safetensors")
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16).to(torch.float32)), name


def test_strict_lists_missing_and_unexpected_keys(tmp_path):
    annot.save(GPT(n_layer=1, n_embd=32, n_head=4, vocab_size=97, block_size=32), tmp_path / "ck")
    model = GPT(**SHAPE)
    with pytest.raises(annot.CheckpointError) as info:
        annot.load(model, tmp_path / "ck")
    assert "missing 12: transformer.h.1.ln_1.weight" in str(info.value)
    assert "strict=False" in str(info.value)
    report = annot.load(model, tmp_path / "ck", strict=False)
    assert len(report.missing) == 12 and report.unexpected == ()


def test_unexpected_keys(tmp_path):
    annot.save(GPT(**SHAPE), tmp_path / "ck")
    model = GPT(n_layer=1, n_embd=32, n_head=4, vocab_size=97, block_size=32)
    with pytest.raises(annot.CheckpointError, match="unexpected 12: transformer.h.1"):
        annot.load(model, tmp_path / "ck")


def test_shape_mismatch_is_named(tmp_path):
    annot.save(GPT(**SHAPE), tmp_path / "ck")
    model = GPT(**{**SHAPE, "vocab_size": 98})
    with pytest.raises(annot.CheckpointError, match=r"transformer.wte.weight: checkpoint shape \(97, 32\)"):
        annot.load(model, tmp_path / "ck")


def test_bad_paths(tmp_path):
    with pytest.raises(annot.CheckpointError, match="no such file"):
        annot.load(GPT(**SHAPE), tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(annot.CheckpointError, match="no model.safetensors"):
        annot.load(GPT(**SHAPE), tmp_path / "empty")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(annot.CheckpointError, match=r"junk.safetensors: a header of \d+ bytes is not plausible"):
        annot.load(GPT(**SHAPE), tmp_path / "junk.safetensors")


def test_save_refuses_to_overwrite_unless_asked(tmp_path):
    annot.save(_trained_gpt(), tmp_path / "ck")
    with pytest.raises(annot.CheckpointError, match="overwrite=True"):
        annot.save(_trained_gpt(), tmp_path / "ck")
    annot.save(_trained_gpt(seed=5), tmp_path / "ck", overwrite=True)
    model = GPT(**SHAPE)
    annot.load(model, tmp_path / "ck")
    _assert_same_state(_trained_gpt(seed=5), model)


def test_a_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    from annot.checkpoint_io import safetensors_file as _safetensors

    def broken(self, name, tensor):
        raise OSError("disk full")

    monkeypatch.setattr(_safetensors.SafetensorsWriter, "write", broken)
    with pytest.raises(OSError, match="disk full"):
        annot.save(_trained_gpt(), tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_meta_tensors(tmp_path):
    with annot.meta_init():
        model = GPT(**SHAPE)
    with pytest.raises(annot.CheckpointError, match="meta tensors"):
        annot.save(model, tmp_path / "ck")


def test_meta_model_without_record_cannot_be_loaded(tmp_path):
    annot.save(_trained_gpt(), tmp_path / "ck")
    with torch.device("meta"):
        model = GPT(**SHAPE)
    with pytest.raises(annot.CheckpointError, match="non-persistent buffers .* are on the meta device"):
        annot.load(model, tmp_path / "ck")


def test_transformers_files_load_and_our_files_load_into_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    reference.save_pretrained(tmp_path / "hf")
    with annot.meta_init():
        model = transformers.LlamaForCausalLM(config)
    annot.load(model, tmp_path / "hf")
    _assert_same_state(reference, model)
    ids = torch.randint(0, 97, (2, 8))
    assert torch.equal(model(ids).logits, reference(ids).logits)
    annot.save(model, tmp_path / "ours", max_shard_bytes=40_000)
    assert (tmp_path / "ours" / "config.json").is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    _assert_same_state(reference, back)


class _Derived(torch.nn.Module):
    """A non-persistent buffer computed from a weight in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.register_buffer("weight_sum", self.a.weight.detach().sum(0), persistent=False)


class _Alias(torch.nn.Module):
    """A non-persistent buffer that is a view of the persistent bias's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.register_buffer("bias_view", self.a.bias.detach(), persistent=False)


def _saved_linear(folder, dtype: torch.dtype):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.full((4, 4), 7.0, dtype=dtype), "a.bias": torch.arange(4, dtype=dtype)},
              str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.float64])  # mapped / read (converted)
@pytest.mark.parametrize("mmap", [False, True])
def test_a_buffer_computed_from_a_loaded_weight_is_eager_and_the_weight_the_file(tmp_path, file_dtype, mmap):
    """The replay computes ``weight_sum`` from the weight's initial values (as eager
    construction does) and, with mmap, never writes them into the mapped weight."""
    torch.manual_seed(0)
    eager = _Derived()
    torch.manual_seed(0)
    with annot.meta_init():
        model = _Derived()
    report = annot.load(model, _saved_linear(tmp_path, file_dtype), mmap=mmap)
    assert report.bytes_mapped == (80 if mmap and file_dtype == torch.float32 else 0)
    assert torch.equal(model.a.weight, torch.full((4, 4), 7.0))
    assert torch.equal(model.a.bias, torch.arange(4.0))
    assert torch.equal(model.weight_sum, eager.weight_sum)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_buffer_viewing_a_loaded_weight_is_refused_not_left_empty(tmp_path, mmap):
    with annot.meta_init():
        model = _Alias()
    with pytest.raises(annot.DeferredInitError, match="bias_view share storage"):
        annot.load(model, _saved_linear(tmp_path, torch.float32), mmap=mmap)
