"""`annot.from_pretrained(dir, engine, peft_config=...)`: the base checkpoint read into a
PEFT model built on the meta device, adapters initialised as PEFT does (one process here;
the 2-rank runs are in test_finetune.py)."""

from __future__ import annotations

import pytest
import torch

import annot
from tests.finetune.cases import LORA, SEED
from tests.huggingface.hf_archs import ARCHS, probe_inputs
from tests.mapped_files import not_mapped

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("mmap", [False, True])
def test_equal_to_transformers_from_pretrained_then_get_peft_model(tmp_path, mmap):
    trained_base = ARCHS["llama"].build()
    with torch.no_grad():  # weights unlike any fresh initialization
        for param in trained_base.parameters():
            param.add_(0.5)
    trained_base.save_pretrained(tmp_path)

    torch.manual_seed(SEED)
    loaded = annot.from_pretrained(tmp_path, engine=None, peft_config=LORA(), strict=True, mmap=mmap)
    # Mapped: every base weight (frozen, never written) stays the file's page; the
    # adapters are new (initialized, not in the file).
    unmapped = not_mapped(loaded, tmp_path)
    assert unmapped == [n for n, p in loaded.named_parameters() if not mmap or ".lora_" in n]
    # What a user does without annot: load the base (no initialization runs for what the
    # file holds, so no random numbers are drawn for it), then add the adapters.
    torch.manual_seed(SEED)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    eager = peft.get_peft_model(reference, LORA())

    assert isinstance(loaded, peft.PeftModel)
    got, want_eager = loaded.state_dict(), eager.state_dict()
    want_base = {f"base_model.model.{k}": v for k, v in trained_base.state_dict().items()}
    for name, value in got.items():
        assert torch.equal(value, want_eager[name]), name
        if ".lora_" not in name:
            assert torch.equal(value, want_base[name.replace(".base_layer.", ".")]), name
    # The adapters start as PEFT starts them (B = 0): the model is the base model.
    with torch.no_grad():
        torch.testing.assert_close(loaded(**probe_inputs("llama")).logits,
                                   trained_base.eval()(**probe_inputs("llama")).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_modules_to_save_load_both_copies_as_peft_over_transformers(tmp_path, tied):
    """``modules_to_save=["lm_head"]``: PEFT keeps the original head and a trained copy,
    both made from the base head; a tied head is in the checkpoint once, under the
    embedding's key. Before, strict=True refused the load (the copy, or the original,
    "missing") and strict=False trained from a random head (loss 5.603 against 5.555)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)

    def lora():
        return peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])

    torch.manual_seed(SEED)
    loaded = annot.from_pretrained(tmp_path, engine=None, peft_config=lora(), strict=True)
    torch.manual_seed(SEED)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), lora())
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert {k for k in got if ".modules_to_save." in k or ".original_module." in k} == {
        "base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.original_module.weight"}
    assert [k for k in want if ".lora_" not in k and not torch.equal(got[k], want[k])] == []


def test_a_bfloat16_base_loads_as_peft_over_transformers(tmp_path):
    """PEFT casts each new adapter to its base layer's dtype, then (autocast_adapter_dtype)
    back to float32. On the meta build the first cast swapped fake parameters the record
    holds weak references to, and the load failed ("Couldn't swap Linear.weight")."""
    ARCHS["llama"].build().save_pretrained(tmp_path)
    torch.manual_seed(SEED)
    loaded = annot.from_pretrained(tmp_path, engine=None, peft_config=LORA(), torch_dtype=torch.bfloat16)
    torch.manual_seed(SEED)
    eager = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), LORA())
    got, want = loaded.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert value.dtype == got[name].dtype and torch.equal(got[name], value), name
    assert {v.dtype for n, v in got.items() if ".lora_" in n} == {torch.float32}
