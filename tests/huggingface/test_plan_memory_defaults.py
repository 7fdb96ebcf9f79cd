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


@pytest.mark.parametrize("case", ["image_classification/imagegpt",
                                  # 5 s here: the sweep lane's, beside the class sweep that found it
                                  pytest.param("speech_seq2seq/kyutai_speech_to_text", marks=pytest.mark.sweep)])
def test_models_taking_other_token_ids_are_traced_on_their_own_batch(capsys, tmp_path, case):
    """ImageGPT's classifier takes its pixels as token ids, Kyutai's speech-to-text its
    audio as token ids with a codebook axis: both were traced as language models ("Expected
    input batch_size (2) to match target batch_size (128)"; "Attempting to broadcast a
    dimension of length 5"), the class sweep's cases."""
    from tests.huggingface.probe_classes import architectures, tiny_model

    kind, arch = case.split("/")
    tiny_model(kind, arch, architectures(kind)[arch], tmp_path)
    code = annot_main(["plan", str(tmp_path), "--memory", "--batch", "2", "--seq", "64"])
    _, err = capsys.readouterr()
    assert code == 0, err


@pytest.mark.sweep  # 5-15 s each; the default lane checks the line below on the meta model
@pytest.mark.parametrize("case", ["image_text/aria", "image_text/instructblip"])
def test_a_tower_that_reads_its_inputs_values_is_planned(capsys, tmp_path, case):
    """Aria's and InstructBLIP's towers read a value of their inputs (an attention mask's):
    built on the meta device they cannot run, so the line saying what the trace is fed
    and the Q-Former's token count must not run them there ("Tensor.item() cannot be
    called on meta tensors"), the class sweep's cases."""
    from tests.huggingface.probe_classes import architectures, tiny_model

    kind, arch = case.split("/")
    tiny_model(kind, arch, architectures(kind)[arch], tmp_path)
    code = annot_main(["plan", str(tmp_path), "--memory", "--batch", "2", "--seq", "64"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "image(s) of" in out


def test_the_line_saying_what_the_trace_is_fed_does_not_run_a_tower_on_meta():
    import torch
    import transformers

    from annot.memory.inputs import MediaSizes
    from tests.huggingface.sweep_configs import tiny_config

    with torch.device("meta"):
        aria = transformers.AriaForConditionalGeneration._from_config(tiny_config("aria", "image_text"))
    assert MediaSizes().describe(aria, 2, 64).startswith("traced on 2 sample(s) of 64 tokens, 1 image(s)")
