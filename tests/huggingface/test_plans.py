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
