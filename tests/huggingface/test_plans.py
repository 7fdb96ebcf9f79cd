"""The default plan of each architecture, on the meta device (single process, fast): it
shards the architecture's own layer class, every layer, and nothing absurd."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.policies import Policy, no_split_modules
from tests.huggingface.hf_archs import ARCHS, LAYER_COUNT

# Units besides the layers that an architecture's _no_split_modules names on purpose.
EXTRA_UNITS = {"bert": {"BertEmbeddings"}, "vit": {"ViTEmbeddings"}}


def meta_model(name: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    arch = ARCHS[name]
    with annot.meta_init():
        model = arch.model_cls()._from_config(arch.config(), dtype=dtype or torch.float32)
    return model


@pytest.mark.parametrize("name", list(ARCHS))
def test_plan_shards_the_layer_class(name):
    plan = annot.plan(meta_model(name))
    layer = ARCHS[name].layer
    classes = [u.cls.rpartition(".")[2] for u in plan.units]
    assert classes.count(layer) == LAYER_COUNT[name], plan.table()
    assert set(classes) <= {layer} | EXTRA_UNITS.get(name, set()), plan.table()
    assert all(u.has("shard") for u in plan.units)
    assert all(u.has("checkpoint") for u in plan.units if u.cls.endswith(layer))
    assert plan.warnings == (), plan.warnings


@pytest.mark.parametrize("name", list(ARCHS))
def test_root_keeps_only_what_no_layer_holds(name):
    """Embeddings, final norm and head stay with the root; nothing from inside a layer."""
    plan = annot.plan(meta_model(name))
    layer_paths = [p for u in plan.units if u.cls.endswith(ARCHS[name].layer) for p in u.modules]
    for module in plan.root.modules:
        assert not any(module.startswith(p + ".") for p in layer_paths), (module, plan.table())
    assert plan.root.params + sum(u.params for u in plan.units) == plan.total_params


# These tie their input embeddings to the output head in their default configs.
TIED = ("gemma", "gpt2", "falcon", "opt", "bloom", "bert", "t5")


@pytest.mark.parametrize("name", TIED)
def test_tied_embeddings_share_one_unit(name):
    model = meta_model(name)
    plan = annot.plan(model)
    assert plan.tied, "the model ties its embeddings, the plan must see it"
    for group in plan.tied:
        owners = set()
        for param in group:
            module = param.rpartition(".")[0]
            holder = [u.path for u in plan.units if any(
                module == m or module.startswith(m + ".") for m in u.modules)]
            owners.add(holder[-1] if holder else "(root)")
        assert len(owners) == 1, (group, owners, plan.table())


def test_keep_in_fp32_modules_become_their_own_units_in_half_precision():
    """T5 keeps its ``wo`` projections in fp32 when loaded in fp16 (transformers does the
    same): each is a unit of its own, so no unit mixes fp16 and fp32."""
    from annot.huggingface.model import keep_in_fp32_names

    with annot.meta_init():
        model = ARCHS["t5"].model_cls()._from_config(ARCHS["t5"].config(), dtype=torch.float16)
        kept = keep_in_fp32_names(model, torch.float16)
        for path in kept:
            model.get_submodule(path).float()
    assert len(kept) == LAYER_COUNT["t5"] and all(p.endswith(".wo") for p in kept)
    plan = annot.plan(model)
    fp32_units = [u for u in plan.units if "keep_in_fp32_modules" in u.reason]
    assert sorted(u.path for u in fp32_units) == sorted(kept)
    assert all(set(u.bytes) == {"float32"} for u in fp32_units)
    assert all(set(u.bytes) == {"float16"} for u in plan.units if u not in fp32_units)
    # Without the rule, the blocks would mix dtypes: the plan says so.
    assert len(annot.plan(model, Policy(shard=no_split_modules())).mixed_dtype_units()) == LAYER_COUNT["t5"]


def test_keep_in_fp32_modules_add_no_unit_in_fp32():
    plan = annot.plan(meta_model("t5"))
    assert not [u for u in plan.units if "keep_in_fp32_modules" in u.reason]


def _meta_from_config(model_type: str, **sizes) -> torch.nn.Module:
    """A tiny causal LM of ``model_type`` on the meta device, from transformers' own config."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **sizes)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


ROBERTA_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=128, is_decoder=True)


@pytest.mark.parametrize("model_type", ["camembert", "xlm-roberta", "roberta-prelayernorm"])
@pytest.mark.parametrize("order", ["as found", "reversed"])
def test_every_tied_group_ends_in_one_unit_whatever_the_order(model_type, order, monkeypatch):
    # Two tied groups, weight (embeddings = lm_head.decoder) and bias (lm_head =
    # lm_head.decoder): grouping the weight moved lm_head.decoder into the embeddings'
    # unit and split the bias group, which had been whole at the root (CamemBERT, XLM-R:
    # FSDP2 then refused "Parameter shared with ... another FSDP group").
    from annot.policies import planner

    found = planner._tied_groups
    if order == "reversed":
        monkeypatch.setattr(planner, "_tied_groups", lambda model: found(model)[::-1])
    model = _meta_from_config(model_type, **ROBERTA_SIZES)
    plan = annot.plan(model)
    assert len(plan.tied) == 2
    shard_units = [u for u in plan.units if u.has("shard")]
    for group in plan.tied:
        owners = {next((u.path for u in shard_units if any(
            name.startswith(m + ".") for m in u.modules)), "") for name in group}
        assert len(owners) == 1, (group, owners, plan.table())
    (embeddings,) = [u for u in shard_units if "embeddings" in u.path]
    assert set(embeddings.modules) >= {"lm_head", "lm_head.decoder"}


def test_no_split_modules_naming_only_a_sub_block_shards_the_repeated_layer():
    # RoBERTa-PreLayerNorm's _no_split_modules names its attention, not its layer: the
    # layers' feed-forward weights stayed at the root, unsharded.
    model = _meta_from_config("roberta-prelayernorm", **ROBERTA_SIZES)
    plan = annot.plan(model)
    layers = [f"roberta_prelayernorm.encoder.layer.{i}" for i in range(2)]
    assert [p for p in plan.paths("shard") if ".encoder." in p] == layers
    assert set(layers) <= set(plan.paths("checkpoint"))
    assert "inside repeated_blocks(RobertaPreLayerNormLayer)" in plan.unit(layers[0]).reason
    assert plan.root.params < model.roberta_prelayernorm.encoder.layer[0].output.dense.weight.numel()


def test_a_named_block_that_is_the_repeated_layer_is_kept():
    model = _meta_from_config("llama", hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    plan = annot.plan(model)
    assert plan.paths("shard") == ["model.layers.0", "model.layers.1"]
    assert all("inside" not in u.reason for u in plan.units)


def test_modules_writing_a_cache_the_model_cannot_turn_off_are_not_checkpointed():
    # XLM builds a key/value cache on every forward and takes no use_cache: recomputing a
    # checkpointed attention would write it twice.
    model = _meta_from_config("xlm", emb_dim=64, n_layers=2, n_heads=4, vocab_size=128)
    plan = annot.plan(model)
    attentions = ["transformer.attentions.0", "transformer.attentions.1"]
    assert set(attentions) <= set(plan.paths("shard"))
    assert not set(attentions) & set(plan.paths("checkpoint"))
    assert "transformer.ffns.0" in plan.paths("checkpoint")
    assert any("cannot turn off (no module takes use_cache)" in w for w in plan.warnings)


def test_checkpoint_true_leaves_out_modules_writing_a_cache_the_model_cannot_turn_off():
    # checkpoint=True ("every unit") recomputed XLM's attentions and crashed in backward
    # (issue #29's sweep): every unit but those.
    from annot.engines.registry import get_engine

    model = _meta_from_config("xlm", emb_dim=64, n_layers=2, n_heads=4, vocab_size=128)
    paths = get_engine("fsdp2").checkpoint_paths(model, annot.plan(model), True)
    assert "transformer.ffns.0" in paths
    assert not {"transformer.attentions.0", "transformer.attentions.1"} & set(paths)
