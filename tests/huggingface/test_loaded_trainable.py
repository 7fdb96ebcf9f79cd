"""Parameters a constructor freezes but transformers' ``from_pretrained`` trains
(Marian's, Pegasus' and RoFormer's sinusoidal position tables, issue #29): annot's
``from_pretrained`` trains the same ones and its Plan says so (docs/design.md, pitfall 46)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import annot  # noqa: E402
from annot.cli.main import main as annot_main  # noqa: E402
from tests.huggingface.sweep_configs import tiny_config  # noqa: E402

# model type -> the position table its constructor creates frozen
FROZEN_WHEN_BUILT = {
    "marian": "model.decoder.embed_positions.weight",
    "pegasus": "model.decoder.embed_positions.weight",
    "roformer": "roformer.encoder.embed_positions.weight",
}


@pytest.fixture(scope="module", params=sorted(FROZEN_WHEN_BUILT))
def saved(request, tmp_path_factory):
    model_type = request.param
    directory = tmp_path_factory.mktemp(model_type)
    built = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
    # The premise: eager construction freezes the table.
    assert not built.get_parameter(FROZEN_WHEN_BUILT[model_type]).requires_grad
    built.save_pretrained(directory)
    return model_type, directory


def test_from_pretrained_trains_what_transformers_from_pretrained_trains(saved):
    model_type, directory = saved
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory)
    ours = annot.from_pretrained(directory, engine=None)
    expected = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert FROZEN_WHEN_BUILT[model_type] in expected
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == expected


def test_plan_table_names_the_parameters_trained_against_their_constructor(saved, capsys):
    model_type, directory = saved
    assert annot_main(["plan", str(directory)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert any("from_pretrained" in w and FROZEN_WHEN_BUILT[model_type] in w for w in warnings), warnings


def test_a_parameter_transformers_init_freezes_after_the_load_stays_frozen(tmp_path):
    """HRM's ``z_L_init`` is loaded, made trainable by transformers' loader and frozen
    again by its ``_init_weights``, which ``from_pretrained`` runs after the files: plain
    transformers does not train it, so annot must not either (issue #29's sweep found a
    silent difference here)."""
    config = tiny_config("hrm_text")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ours = annot.from_pretrained(tmp_path, engine=None)
    assert not theirs.get_parameter("model.z_L_init").requires_grad
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == \
        {n for n, p in theirs.named_parameters() if p.requires_grad}
    # the pass left no marks behind
    assert not any(hasattr(t, "_is_hf_initialized") for t in [*ours.parameters(), *ours.modules()])


def test_a_table_the_checkpoint_leaves_out_trains_as_transformers_recreates_it(tmp_path):
    """MarianMT ignores its sinusoidal tables on save (``_keys_to_ignore_on_save``):
    transformers' ``from_pretrained`` re-creates each missing parameter as a new
    trainable ``Parameter``; annot kept the constructor's frozen one, and its step was
    1.2e-4 off from the second step (issue #42). The values are the constructor's in both."""
    import torch

    config = tiny_config("marian", task="seq2seq")
    transformers.MarianMTModel(config).save_pretrained(tmp_path)
    theirs = transformers.MarianMTModel.from_pretrained(tmp_path)
    ours = annot.from_pretrained(tmp_path, engine=None)
    table = "model.encoder.embed_positions.weight"
    assert theirs.get_parameter(table).requires_grad and ours.get_parameter(table).requires_grad
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == \
        {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert torch.equal(ours.get_parameter(table), theirs.get_parameter(table))
