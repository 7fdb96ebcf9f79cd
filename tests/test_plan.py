"""Building, validating and serializing Plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.policies import (
    Action,
    Plan,
    PlanError,
    Policy,
    by_class,
    by_name,
    every_nth,
    make_plan,
    no_split_modules,
)
from examples.gpt.model import Block

BLOCKS = ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_default_plan_of_the_example_gpt(gpt_meta):
    plan = annot.plan(gpt_meta)
    assert plan.paths() == BLOCKS
    for unit in plan.units:
        assert unit.actions == (Action.SHARD, Action.CHECKPOINT)
        assert unit.cls.endswith(".Block")
        assert unit.reason == "shard,checkpoint: marked(Block)"
    assert plan.tied == (("transformer.wte.weight", "lm_head.weight"),)
    assert plan.root.modules == ("transformer.wte", "transformer.wpe", "transformer.ln_f")


def test_counts_and_bytes_add_up_without_allocating(gpt_meta):
    plan = annot.plan(gpt_meta)
    block_params = sum(p.numel() for p in gpt_meta.transformer.h[0].parameters())
    assert all(u.params == block_params for u in plan.units)
    assert all(u.bytes == {"float32": 4 * block_params} for u in plan.units)
    total = sum(p.numel() for p in gpt_meta.parameters())  # tied weight counted once
    assert plan.total_params == total == sum(u.params for u in plan.units) + plan.root.params
    assert all(p.is_meta for p in gpt_meta.parameters())


def test_units_are_ordered_children_before_parents():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model = nn.Sequential(inner, nn.Linear(2, 2))
    plan = make_plan(model, by_name("0", "0.*", "1"))
    assert plan.paths() == ["0.0", "0.1", "0", "1"]


def test_policy_per_action_and_every_nth(gpt_meta):
    policy = Policy(shard=by_class(Block), checkpoint=every_nth(2, by_class(Block)))
    plan = make_plan(gpt_meta, policy)
    assert plan.paths("shard") == BLOCKS
    assert plan.paths("checkpoint") == [BLOCKS[0], BLOCKS[2]]
    assert plan.unit(BLOCKS[0]).reason == "shard: class(Block); checkpoint: every_nth(2) of class(Block)"


def test_override_wins_and_is_named_in_the_reason(gpt_meta):
    policy = Policy(shard=by_class(Block), checkpoint=by_class(Block)).override(
        by_name("transformer.h.1"), checkpoint=False
    )
    plan = make_plan(gpt_meta, policy)
    assert plan.unit(BLOCKS[1]).actions == (Action.SHARD,)
    assert "override: name(transformer.h.1)" in plan.unit(BLOCKS[1]).reason
    with pytest.raises(ValueError, match="at least one"):
        policy.override(by_name("x"))


def test_offload_target_comes_from_marks_then_policy(gpt_meta):
    annot.mark(gpt_meta.transformer.h[0], offload="nvme")
    plan = annot.plan(gpt_meta)
    assert plan.unit(BLOCKS[0]).offload_to == "nvme"
    assert plan.unit(BLOCKS[0]).actions == (Action.SHARD, Action.CHECKPOINT, Action.OFFLOAD)
    plan = make_plan(gpt_meta, Policy(shard=by_class(Block), offload=by_class(Block)))
    assert [u.offload_to for u in plan.units] == ["nvme", "cpu", "cpu"]


def test_bare_rule_means_shard(gpt_meta):
    plan = make_plan(gpt_meta, by_class(Block))
    assert all(u.actions == (Action.SHARD,) for u in plan.units)


def test_json_round_trip(gpt_meta):
    plan = make_plan(
        gpt_meta,
        Policy(shard=by_class(Block, nn.Embedding), checkpoint=by_class(Block), group_tied=True),
    )
    data = plan.to_dict()
    assert {"units", "root", "tied"} <= set(data)
    assert set(data["units"][0]) >= {"path", "cls", "params", "actions", "reason"}
    assert data["units"][0]["actions"] == ["shard"]
    assert Plan.from_json(plan.to_json()) == plan


def test_from_json_rejects_garbage():
    with pytest.raises(PlanError, match="bad JSON"):
        Plan.from_json("{nope")
    with pytest.raises(PlanError, match="not a valid plan"):
        Plan.from_json('{"units": []}')
    with pytest.raises(PlanError, match="version 99"):
        Plan.from_json('{"version": 99}')


def test_table_lists_units_root_and_ties(gpt_meta):
    table = annot.plan(gpt_meta).table(collapse=False)
    assert "transformer.h.2" in table and "(root)" in table
    assert "tied: transformer.wte.weight = lm_head.weight" in table
    assert "3 units: 3 shard, 3 checkpoint, 0 offload" in table


# Validation ---------------------------------------------------------------


def test_empty_selection_is_an_error(gpt_meta):
    with pytest.raises(PlanError, match=r"rule class\(Nothing\) selects no module for shard"):
        make_plan(gpt_meta, Policy(shard=by_class("Nothing")))


def test_policy_selecting_nothing_at_all_is_an_error(gpt_meta):
    policy = Policy(shard=by_class(Block)).override(by_class(Block), shard=False)
    with pytest.raises(PlanError, match="selects no module of GPT: the plan would do nothing"):
        make_plan(gpt_meta, policy)


def test_unmarked_model_without_hf_metadata_needs_a_policy():
    with pytest.raises(PlanError, match="no marked blocks and no HuggingFace _no_split_modules"):
        make_plan(nn.Sequential(nn.Linear(2, 2)))


def test_tied_parameters_split_across_units_is_an_error(gpt_meta):
    with pytest.raises(PlanError) as info:
        make_plan(gpt_meta, by_class(nn.Embedding))
    message = str(info.value)
    assert "tied parameters are split across shard units" in message
    assert "transformer.wte.weight in module `transformer.wte`" in message
    assert "lm_head.weight in the root" in message
    assert "group_tied=True" in message


def test_group_tied_puts_tied_modules_in_one_unit(gpt_meta):
    plan = make_plan(gpt_meta, Policy(shard=by_class(nn.Embedding), group_tied=True))
    unit = plan.unit("transformer.wte")
    assert unit.modules == ("transformer.wte", "lm_head")
    assert plan.unit("lm_head") is unit
    assert "grouped: tied transformer.wte.weight = lm_head.weight" in unit.reason


def test_group_tied_merges_two_units():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.b.weight = self.a.weight

    plan = make_plan(Tied(), Policy(shard=by_name("a", "b"), group_tied=True))
    assert [u.modules for u in plan.units] == [("a", "b")]
    with pytest.raises(PlanError, match="a.weight in module `a`, b.weight in module `b`"):
        make_plan(Tied(), by_name("a", "b"))


def test_mixed_dtypes_inside_a_unit_is_a_warning_naming_the_engines(gpt_meta):
    gpt_meta.transformer.h[1].mlp.to(torch.bfloat16)
    plan = annot.plan(gpt_meta)
    (message,) = plan.warnings
    assert "module `transformer.h.1` (Block) mixes dtypes" in message
    assert "bfloat16 (transformer.h.1.mlp.c_fc.weight" in message
    # the bf16 MLP trains: only DDP takes that (tests/engines/test_dtype_mixes.py: each engine)
    assert "its trainable parameters are float32 and bfloat16: only DDP trains that" in message
    assert plan.mixed_dtype_units() == ["transformer.h.1"]


def test_mixed_dtypes_in_the_root_is_a_warning(gpt_meta):
    gpt_meta.transformer.ln_f.to(torch.float16)
    plan = annot.plan(gpt_meta)
    assert any(w.startswith("the root (what no unit holds) (GPT) mixes dtypes") for w in plan.warnings)
    assert plan.mixed_dtype_units() == ["(root)"]


def test_frozen_and_trainable_parameters_may_share_a_unit(gpt_meta):
    gpt_meta.transformer.h[0].ln_1.requires_grad_(False)
    gpt_meta.transformer.wte.requires_grad_(False)  # tied to lm_head: the root's biggest part
    plan = annot.plan(gpt_meta)
    assert not plan.warnings
    block = plan.unit("transformer.h.0")
    assert block.trainable == block.params - 2 * 32  # ln_1's weight and bias frozen
    assert plan.unit("transformer.h.1").trainable == plan.unit("transformer.h.1").params
    assert plan.root.trainable == plan.root.params - 64 * 32  # the tied embedding, counted once


def test_the_table_shows_trainable_counts_once_something_is_frozen(gpt_meta):
    assert "trainable" not in annot.plan(gpt_meta).table()
    for block in gpt_meta.transformer.h:
        block.requires_grad_(False)
    table = annot.plan(gpt_meta).table()
    header, blocks, root = table.splitlines()[1:4]
    assert header.split()[:5] == ["#", "unit", "class", "params", "trainable"]
    column = header.index("trainable")
    assert blocks[column:].split()[0] == "frozen"
    assert root[column:].split()[0] != "frozen"


def test_a_nested_unit_takes_its_parameters_out_of_the_parent(gpt_meta):
    # The bf16 MLP as a unit of its own makes the block uniform again.
    gpt_meta.transformer.h[1].mlp.to(torch.bfloat16)
    policy = Policy(shard=by_class(Block) | by_name("transformer.h.1.mlp"))
    plan = make_plan(gpt_meta, policy)
    assert plan.paths()[:3] == [BLOCKS[0], "transformer.h.1.mlp", BLOCKS[1]]
    assert set(plan.unit("transformer.h.1.mlp").bytes) == {"bfloat16"}
    assert set(plan.unit(BLOCKS[1]).bytes) == {"float32"}


def test_hf_default_plan_reports_absent_no_split_names(tiny_llama_meta):
    tiny_llama_meta._no_split_modules = ["LlamaDecoderLayer", "NotThere"]
    plan = annot.plan(tiny_llama_meta)
    assert plan.paths("shard") == ["model.layers.0", "model.layers.1"]
    assert plan.paths("checkpoint") == ["model.layers.0", "model.layers.1"]
    assert plan.warnings == ("_no_split_modules names 'NotThere', which does not occur in this model",)
    assert "warning: _no_split_modules names 'NotThere'" in plan.table()


def test_no_split_names_all_absent_is_an_empty_selection():
    class Model(nn.Module):
        _no_split_modules = ["Ghost"]

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    with pytest.raises(PlanError, match="no_split_modules selects no module for shard"):
        make_plan(Model(), Policy(shard=no_split_modules()))


def test_table_collapses_runs_of_identical_blocks(gpt_meta):
    plan = annot.plan(gpt_meta)
    collapsed = plan.table()
    assert "0-2  transformer.h.[0-2]  Block" in collapsed
    assert "x3" in collapsed
    full = plan.table(collapse=False)
    assert all(f"{i}  transformer.h.{i} " in full for i in range(3))


def test_table_does_not_collapse_units_that_differ(gpt_meta):
    plan = make_plan(gpt_meta, Policy(shard=by_class(Block), checkpoint=by_name("transformer.h.1")))
    assert "transformer.h.[" not in plan.table()


def test_hf_model_without_no_split_modules_falls_back_to_the_trunk_and_says_so(tiny_llama_meta):
    for module in tiny_llama_meta.modules():  # a transformers model that declares no blocks
        if hasattr(module, "_no_split_modules"):
            module._no_split_modules = None
    plan = annot.plan(tiny_llama_meta)
    assert plan.paths("shard") == ["model.layers.0", "model.layers.1"]
    assert plan.unit("model.layers.0").reason == "shard,checkpoint: repeated_blocks(LlamaDecoderLayer)"
    assert any("declares no _no_split_modules: fell back" in w for w in plan.warnings)


def test_hf_default_groups_tied_embeddings_and_head():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = annot.plan(model)
    assert plan.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert plan.paths() == ["model.layers.0", "model.layers.1"]  # both in the root: no split
