"""Tensors a constructor keeps as plain attributes (not parameters, not buffers) are
recorded at construction and given their values by `materialize`, whole, bitwise those
of eager construction; the memory planner's fake copy makes them fake. Diffusers'
QwenImage, Lumina2, Kandinsky5, NucleusMoE and Sana-WM keep their rotary tables so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.meta.deferred import deferred_init_of, meta_device_init
from annot.meta.materialization import materialize
from annot.meta.tensor_attributes import map_tensor_attributes, tensor_attributes


class Rotary(nn.Module):
    """A table computed in ``__init__`` as a plain attribute, a list of them as
    Lumina2 keeps, and a random one (replayed from the recorded random state)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        positions = torch.arange(6, dtype=torch.float64)
        self.freqs = torch.outer(positions, 1.0 / (10000 ** (torch.arange(0, 4, 2) / 4)))
        self.tables = [torch.polar(torch.ones(3, 2), torch.arange(6.0).view(3, 2)), torch.randn(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.freqs[: x.shape[0], :1].to(x.dtype) + self.tables[1].sum()


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotary(x)


def _eager() -> Holder:
    torch.manual_seed(3)
    return Holder()


@pytest.mark.parametrize("recording", [annot.meta_init, meta_device_init], ids=["fake", "meta-device"])
def test_materialize_gives_plain_tensor_attributes_their_eager_values(recording):
    torch.manual_seed(3)
    with recording():
        model = Holder()
    attributes = tensor_attributes(model)
    assert sorted(attributes) == ["rotary.freqs", "rotary.tables.0", "rotary.tables.1"]
    assert all(t.is_meta for t in attributes.values())  # nothing allocated, nothing fake left
    assert sorted(deferred_init_of(model).attributes) == sorted(attributes)
    annot.materialize(model)
    eager = _eager()
    got, want = tensor_attributes(model), tensor_attributes(eager)
    assert isinstance(model.rotary.tables, list)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)


def test_checkpoint_skips_parameters_and_still_computes_the_attributes():
    torch.manual_seed(3)
    with meta_device_init():
        model = Holder()
    names = [n for n, _ in model.named_parameters()]
    materialize(model, skip=set(names))  # as a checkpoint load does
    assert torch.equal(model.rotary.freqs, _eager().rotary.freqs)


def test_a_real_attribute_from_outside_is_left_as_it_is():
    table = torch.arange(3.0)

    class Given(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.table = table

    with annot.meta_init():
        model = Given()
    assert model.table is table and deferred_init_of(model).attributes == {}
    annot.materialize(model)
    assert model.table is table


def test_map_keeps_the_container_kind():
    module = nn.Module()
    module.pair = (torch.zeros(1), 3, torch.ones(1))
    module.items = [torch.zeros(1)]
    map_tensor_attributes(module, lambda _, t: t + 1)
    assert isinstance(module.pair, tuple) and module.pair[1] == 3 and torch.equal(module.pair[2], torch.full((1,), 2.0))
    assert isinstance(module.items, list) and torch.equal(module.items[0], torch.ones(1))


def test_planner_fake_copy_makes_attributes_fake():
    from torch._subclasses.fake_tensor import FakeTensor

    from annot.memory.activations import fake_copy

    with meta_device_init():
        model = Holder()
    copy, mode = fake_copy(model, None)
    assert all(isinstance(t, FakeTensor) and t.fake_mode is mode for t in tensor_attributes(copy).values())
    with mode:
        out = copy(torch.empty(5, 4))
    assert out.shape == (5, 4)
