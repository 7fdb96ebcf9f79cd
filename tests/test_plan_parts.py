"""Plans of models made of parts: units split where their parameters' dtypes differ
(docs/design.md, pitfall 57), the last structural fallback (list elements), blocks
`_no_split_modules` forgets, the towers of a multimodal model, roles and `annot.freeze`.
Small synthetic models on the meta device; the real architectures are in
tests/huggingface/test_multimodal_plans.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.policies import Policy, by_role, list_elements, make_plan, repeated_blocks
from annot.policies.roles import module_roles


class Block(nn.Module):
    """A bfloat16 block whose own bare parameter is kept in float32 (Wan's
    ``scale_shift_table``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.ffn = nn.Sequential(nn.Linear(8, 8, dtype=torch.bfloat16), nn.Linear(8, 8, dtype=torch.bfloat16))
        self.table = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.attn(x)) * self.table


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.table = nn.Parameter(torch.zeros(8))
        self.out = nn.Linear(8, 8, dtype=torch.bfloat16)


def split_policy(**options: object) -> Policy:
    return Policy(shard=annot.by_class(Block), checkpoint=annot.by_class(Block), split_dtypes=True, **options)


def test_a_unit_mixing_trainable_dtypes_is_split_by_dtype():
    with torch.device("meta"):
        model = Denoiser()
    plan = make_plan(model, split_policy())
    split = {u.path for u in plan.units if "split_dtypes" in u.reason}
    assert split == {"embed", "out", "blocks.0.attn", "blocks.0.ffn", "blocks.1.attn", "blocks.1.ffn"}, plan.table()
    for unit in plan.units:
        assert len(unit.bytes) == 1, (unit.path, unit.bytes)
        assert unit.has("checkpoint") == unit.path.endswith(("0", "1")), unit  # the blocks only
    assert plan.root.bytes.keys() == {"float32"} and plan.mixed_dtype_units() == []
    assert plan.unit("blocks.0").bytes == {"float32": 32}


def test_without_split_dtypes_the_mixed_unit_is_a_warning():
    with torch.device("meta"):
        model = Denoiser()
    plan = make_plan(model, Policy(shard=annot.by_class(Block)))
    assert set(plan.mixed_dtype_units()) == {"blocks.0", "blocks.1", "(root)"}
    assert any("mixes dtypes" in w for w in plan.warnings)


def test_frozen_parameters_of_another_dtype_stay_and_dicts_are_never_units():
    """A bfloat16 base frozen beside float32 adapters held in a ModuleDict (PEFT's
    ``lora_A``): FSDP2 takes the mix, and no engine can wrap a ModuleDict."""

    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(8, 8, dtype=torch.bfloat16).requires_grad_(False)
            self.lora_A = nn.ModuleDict({"default": nn.Linear(8, 2)})

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Adapted(), Adapted()])

    with torch.device("meta"):
        model = Model()
    plan = make_plan(model, Policy(shard=annot.by_class(Adapted), split_dtypes=True))
    assert plan.paths() == ["layers.0", "layers.1"], plan.table()
    model.layers[0].base.requires_grad_(True)  # now trainable bf16 beside trainable fp32
    plan = make_plan(model, Policy(shard=annot.by_class(Adapted), split_dtypes=True))
    assert "layers.0.lora_A.default" in plan.paths() and "layers.0.lora_A" not in plan.paths(), plan.table()


def test_list_elements_takes_a_layer_every_depth_shares():
    """ALBERT's shape: one layer group in a list of one, called at every depth."""

    class Group(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](x)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.groups = nn.ModuleList([Group()])

    with torch.device("meta"):
        model = Shared()
    assert list(list_elements().select(annot.policies.model_index.ModelIndex(model))) == ["groups.0"]


def test_lists_of_lists_give_their_inner_elements_never_a_list():
    """Florence-2's vision stages: a list of lists of blocks. A list has no forward for
    FSDP2 to shard around ("fully_shard does not support containers that do not
    implement forward"); the fallbacks take the blocks inside."""

    class Stages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]) for _ in range(2)])

    with torch.device("meta"):
        model = Stages()
    inner = ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1"]
    index = annot.policies.model_index.ModelIndex
    assert list(repeated_blocks().select(index(model))) == inner
    assert list(list_elements().select(index(model))) == inner


def test_a_bare_module_holding_blocks_is_not_a_unit_its_blocks_are():
    """Chameleon's and Emu3's VQ encoder: each level a plain ``nn.Module`` holding a
    ``block`` list, whose blocks the encoder's forward calls directly: FSDP2's hooks on
    the level would never run (its parameters stayed sharded: "got mixed torch.Tensor
    and DTensor")."""

    def level() -> nn.Module:
        holder = nn.Module()
        holder.block = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        return holder

    with torch.device("meta"):
        model = nn.Module()
        model.down = nn.ModuleList([level(), level()])
    blocks = ["down.0.block.0", "down.0.block.1", "down.1.block.0", "down.1.block.1"]
    index = annot.policies.model_index.ModelIndex
    assert list(repeated_blocks().select(index(model))) == blocks
    assert list(list_elements().select(index(model))) == blocks


def test_roles_of_a_model_of_one_part_are_empty_and_by_role_says_so():
    with torch.device("meta"):
        model = Denoiser()
    assert module_roles(model) == {}
    rule = by_role("vision")
    index = annot.policies.model_index.ModelIndex(model)
    assert rule.select(index) == {}
    assert "has no part with role 'vision'" in rule.diagnostics(index)[0]
    with pytest.raises(ValueError, match="has no part with role 'vision'"):
        annot.freeze(model, "vision")


def test_freeze_by_rule_returns_what_it_froze_and_refuses_an_empty_selection():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert annot.freeze(model, annot.by_name("0")) == ["0.weight", "0.bias"]
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert annot.freeze(model, annot.by_name("0")) == []  # already frozen: nothing new
    with pytest.raises(ValueError, match="selects no module"):
        annot.freeze(model, annot.by_name("nothing"))
    with pytest.raises(ValueError, match="needs the parts"):
        annot.freeze(model)


def test_tower_modes_are_checked():
    with pytest.raises(ValueError, match="towers must be one of"):
        Policy(towers="everything")
    assert "towers=whole" in Policy.from_hf(towers="whole").describe()
