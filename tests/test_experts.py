"""Finding mixture-of-experts blocks by structure (`annot.policies.experts`), on small
models built here: what counts as an experts module and what does not."""

from __future__ import annotations

import torch
from torch import nn

import annot


class FusedExperts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.zeros(n, 8, 4))
        self.down = nn.Parameter(torch.zeros(n, 4, 8))


class Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = experts


class Model(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(make()) for _ in range(3))


def _blocks(model: nn.Module) -> list[tuple[str, str, int]]:
    return [(b.path, b.experts, b.num_experts) for b in annot.plan(model, annot.by_name("layers.*")).moe]


def test_fused_3d_stacks_make_an_experts_module_and_its_holder_the_moe_block():
    assert _blocks(Model(lambda: FusedExperts(4))) == [
        (f"layers.{i}", f"layers.{i}.experts", 4) for i in range(3)]


def test_a_list_of_expert_modules_counts_too():
    blocks = _blocks(Model(lambda: nn.ModuleList(nn.Linear(4, 4) for _ in range(3))))
    assert blocks == [(f"layers.{i}", f"layers.{i}.experts", 3) for i in range(3)]


def test_torch_convolutions_and_single_stacks_are_not_experts():
    assert _blocks(Model(lambda: nn.Conv1d(4, 4, 3))) == []  # 3-D weight, torch's own class
    assert _blocks(Model(lambda: FusedExperts(1))) == []  # one expert is no mixture


def test_the_table_collapses_identical_layers_into_one_line():
    table = annot.plan(Model(lambda: FusedExperts(4)), annot.by_name("layers.*")).table()
    moe = [line for line in table.splitlines() if line.startswith("moe:")]
    assert moe == ["moe: layers.[0-2] (Block): 4 experts in .experts (FusedExperts; up, down), "
                   "256 params each"]
