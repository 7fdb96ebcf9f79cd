"""``annot plan --memory`` without ``--seq`` traces at most the model's own longest
sequence (issue #29: BERT-like models with 512 learned positions failed the 2048 trace)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from annot.cli.main import main as annot_main  # noqa: E402

TINY_BERT = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=32, is_decoder=True)


def test_memory_trace_defaults_to_the_models_position_limit(capsys):
    code = annot_main(["plan", "hf:bert", "--kwargs", json.dumps(TINY_BERT), "--memory"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "seq 32 per GPU" in out


def test_an_image_classifier_taking_token_ids_is_traced_with_one_label_per_sample(capsys, tmp_path):
    """ImageGPT's classifier takes its pixels as token ids: it was traced as a language
    model, with a label per token ("Expected input batch_size (2) to match target
    batch_size (128)"); the class sweep's case."""
    import transformers

    config = transformers.ImageGPTConfig(vocab_size=17, n_positions=64, n_embd=16, n_layer=2, n_head=2,
                                         num_labels=3)
    transformers.ImageGPTForImageClassification(config).save_pretrained(tmp_path)
    code = annot_main(["plan", str(tmp_path), "--memory", "--batch", "2", "--seq", "64"])
    _, err = capsys.readouterr()
    assert code == 0, err
