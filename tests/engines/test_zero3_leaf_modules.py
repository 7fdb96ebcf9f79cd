"""Choosing ZeRO-3 leaf modules (DeepSpeed gathers a leaf's parameters whole on entry).
The 2-rank training run with leaves is the ``zero3-leaf-checkpoint`` parity scenario."""

from __future__ import annotations

import pytest
import torch

import annot
from annot.engines.base import WrapRequest
from annot.engines.deepspeed import DeepSpeed, DeepSpeedOptions, set_leaf_modules
from examples.gpt.model import MLP
from tests.engines.small_gpt import N_LAYER, gpt

pytest.importorskip("deepspeed")
from deepspeed.utils import get_z3_leaf_modules  # noqa: E402

MLPS = [f"transformer.h.{i}.mlp" for i in range(N_LAYER)]


@pytest.mark.parametrize("leaf_modules", [[MLP], ["MLP"], MLP])
def test_classes_and_class_names_mark_every_instance(leaf_modules):
    model = gpt()
    assert set_leaf_modules(model, leaf_modules) == MLPS
    assert get_z3_leaf_modules(model) == [model.get_submodule(p) for p in MLPS]


def test_a_rule_marks_exactly_the_modules_it_selects():
    model = gpt()
    assert set_leaf_modules(model, annot.by_name("transformer.h.1.mlp")) == ["transformer.h.1.mlp"]
    assert get_z3_leaf_modules(model) == [model.transformer.h[1].mlp]


@pytest.mark.parametrize("leaf_modules", [["Expert"], annot.by_name("*.experts")])
def test_selecting_nothing_is_an_error(leaf_modules):
    with pytest.raises(ValueError, match="selects no module of GPT"):
        set_leaf_modules(gpt(), leaf_modules)


def test_leaf_modules_outside_zero3_are_refused_before_deepspeed_starts():
    model = gpt()
    options = DeepSpeedOptions(stage=2, leaf_modules=[MLP])
    with pytest.raises(ValueError, match="ZeRO-3 setting.*stage is 2"):
        request = WrapRequest(annot.plan(model), torch.device("cpu"), deferred=False)
        DeepSpeed().check(model, request, options)  # auto_wrap's check step


def test_the_plans_moe_blocks_become_leaves():
    from annot.engines.deepspeed import set_moe_leaves
    from tests.test_experts import FusedExperts, Model

    model = Model(lambda: FusedExperts(4))
    plan = annot.plan(model, annot.by_name("layers.*"))
    set_moe_leaves(model, [block.path for block in plan.moe])
    assert get_z3_leaf_modules(model) == list(model.layers)


@pytest.mark.parametrize(("leaf_modules", "exact"), [((), True), ([MLP], True), (None, False)])
def test_leaf_modules_given_turn_deepspeeds_own_default_leaves_off(leaf_modules, exact):
    # DeepSpeed 0.19 marks Mixtral's and Qwen-MoE's blocks itself at initialize unless its
    # config's zero_optimization.leaf_module names none.
    model = gpt()
    engine = DeepSpeed()
    request = WrapRequest(annot.plan(model), torch.device("cpu"), deferred=False)
    engine.check(model, request, DeepSpeedOptions(stage=3, leaf_modules=leaf_modules))
    leaf_config = engine.config["zero_optimization"].get("leaf_module")
    assert (leaf_config == {"classes": [], "names": [], "name_suffixes": []}) == exact
