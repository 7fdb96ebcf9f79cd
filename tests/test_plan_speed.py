"""The Plan's speed actions: float8 units with their recipe and count of linears, compile
units, chosen by policy rules or, when auto_wrap is asked, given to the repeated blocks;
which linears are eligible for float8 and why the others are not. No torchao needed:
planning only reads module types and shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.policies import Action, Plan, PlanError, Policy, by_class, by_name
from annot.policies.speed import float8_linears, with_speed_actions
from examples.gpt.model import GPT, Block


def gpt(n_embd: int = 64) -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=3, n_head=4, n_embd=n_embd, vocab_size=64, block_size=32)


def test_policy_rules_choose_float8_and_compile_units_printed_per_unit():
    model = gpt()
    plan = annot.plan(model, Policy(shard=by_class(Block), float8=by_class(Block) | by_name("lm_head"),
                                    compile=by_class(Block), float8_recipe="rowwise"))
    blocks = [u for u in plan.units if u.cls.endswith("Block")]
    assert [u.path for u in blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    # c_attn, c_proj (attention), c_fc, c_proj (MLP): four linears per block.
    assert all(u.actions == (Action.SHARD, Action.FLOAT8, Action.COMPILE) for u in blocks)
    assert all((u.float8_recipe, u.float8_linears) == ("rowwise", 4) for u in blocks)
    head = plan.unit("lm_head")
    assert (head.actions, head.float8_linears) == ((Action.FLOAT8,), 1)
    table = plan.table()
    assert "shard,float8(rowwise x4),compile" in table
    assert "4 units: 3 shard, 0 checkpoint, 0 offload, 4 float8, 3 compile" in table
    assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_without_speed_actions_prints_as_before():
    table = annot.plan(gpt()).table()
    assert "float8" not in table and "compile" not in table
    assert "3 units: 3 shard, 3 checkpoint, 0 offload" in table


def test_auto_wraps_default_gives_the_actions_to_the_repeated_blocks():
    model = gpt()
    plan = with_speed_actions(annot.plan(model), model, float8="tensorwise", compile=True)
    assert plan.paths(Action.FLOAT8) == plan.paths(Action.COMPILE) == [
        "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert "float8: float8=tensorwise (repeated block)" in plan.unit("transformer.h.0").reason
    # The embeddings and the head stay with the root, in the model's dtype.
    chosen = float8_linears(model, plan.units)
    assert not any(p.startswith("lm_head") for p in chosen.paths)
    # A recipe given again replaces the Plan's; False drops the action.
    rowwise = with_speed_actions(plan, model, float8="rowwise")
    assert {u.float8_recipe for u in rowwise.units if u.has(Action.FLOAT8)} == {"rowwise"}
    off = with_speed_actions(plan, model, float8=False, compile=False)
    assert not off.paths(Action.FLOAT8) and not off.paths(Action.COMPILE)
    assert all(u.float8_recipe is None for u in off.units)


def test_no_repeated_block_is_an_error_naming_the_fix():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    plan = annot.plan(model, by_name("0"))
    with pytest.raises(PlanError, match=r"no float8 unit and no repeated blocks.*float8=by_class"):
        with_speed_actions(plan, model, float8="tensorwise")


def test_unknown_and_mx_recipes_are_refused():
    model = gpt()
    with pytest.raises(ValueError, match="float8 recipe .delayed.: choose a recipe from tensorwise, rowwise, rowwise_with_gw_hp"):
        with_speed_actions(annot.plan(model), model, float8="delayed")
    with pytest.raises(ValueError, match="float8_recipe must be one of"):
        Policy(float8=by_class(Block), float8_recipe="mxfp8")


class Moe(nn.Module):
    """A block with a router beside its experts, a linear of odd width and a subclass."""

    class Gated(nn.Linear):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(64, 16, bias=False)
        self.experts = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.odd = nn.Linear(64, 40)
        self.gated = Moe.Gated(64, 64)


def test_eligibility_leaves_routers_odd_widths_and_subclasses_with_the_reason():
    model = nn.Sequential(Moe(), Moe())
    plan = annot.plan(model, Policy(shard=by_class(Moe), float8=by_class(Moe)))
    chosen = float8_linears(model, plan.units)
    assert chosen.chosen == {"0": ("0.experts.0", "0.experts.1"), "1": ("1.experts.0", "1.experts.1")}
    assert chosen.kept["0.gate"] == "a mixture-of-experts router"
    assert "40 x 64: float8 matmuls need both dimensions multiples of 16" in chosen.kept["0.odd"]
    assert "a Gated, not a plain nn.Linear" in chosen.kept["0.gated"]
    assert "float8: 4 linears in 2 units" in chosen.describe()
    assert plan.unit("0").float8_linears == 2


def test_a_nested_unit_without_float8_keeps_its_linears():
    model = gpt()
    plan = annot.plan(model, Policy(shard=by_class(Block) | by_name("transformer.h.*.mlp"),
                                    float8=by_class(Block)))
    chosen = float8_linears(model, plan.units)
    assert chosen.chosen["transformer.h.0"] == ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj")


def test_overrides_set_and_clear_the_speed_actions():
    model = gpt()
    policy = Policy(shard=by_class(Block), float8=by_class(Block), compile=by_class(Block))
    policy = policy.override(by_name("transformer.h.0"), float8=False, compile=False)
    plan = annot.plan(model, policy)
    assert plan.unit("transformer.h.0").actions == (Action.SHARD,)
    assert plan.unit("transformer.h.1").actions == (Action.SHARD, Action.FLOAT8, Action.COMPILE)


def test_compile_goes_to_the_outermost_repeated_blocks_float8_to_every_one():
    model = gpt()
    plan = annot.plan(model, Policy(shard=by_class(Block) | by_name("transformer.h.*.mlp")))
    sped = with_speed_actions(plan, model, float8="tensorwise", compile=True)
    assert sped.paths(Action.COMPILE) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert len(sped.paths(Action.FLOAT8)) == 6  # the MLPs own their linears: float8 there too


def test_annot_plan_shows_the_speed_actions_and_refuses_float8_with_quantize(capsys):
    from annot.cli.main import main

    assert main(["plan", "examples/gpt/model.py:GPT", "--float8", "rowwise", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "float8(rowwise x4),compile" in out and "4 float8, 4 compile" in out
    assert main(["plan", "examples/gpt/model.py:GPT", "--float8", "tensorwise", "--lora", "8",
                 "--quantize", "nf4"]) == 2
    assert "--float8 with --quantize" in capsys.readouterr().err
