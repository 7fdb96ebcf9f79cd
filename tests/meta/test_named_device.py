"""meta_init with constructors that name a device: the replay runs every random operation
on the one CPU generator, so values are bitwise an eager CPU build's with the same seed
whatever device the constructor named (docs/design.md, pitfall 33). No GPU is needed:
the record never builds on the device named, so "cuda" is accepted on a CPU-only torch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import annot
from annot.meta.deferred import deferred_init_of, meta_device_init


class TwoLayers(nn.Module):
    """The first layer on the device the caller names, the second on the default one:
    on a GPU build the two would draw from different generators."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8, device=device)
        self.second = nn.Linear(8, 4)
        self.register_buffer("noise", torch.randn(4, device=device), persistent=False)


def _eager(seed: int) -> TwoLayers:
    torch.manual_seed(seed)
    return TwoLayers("cpu")


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


# (device named in the constructor call, device context around the construction)
CASES = {
    "cuda-argument": ("cuda", None),
    "cuda-context": (None, "cuda"),
    "meta-argument-in-cpu-context": ("meta", "cpu"),
    "cpu-argument-in-meta-context": ("cpu", "meta"),
}


@pytest.mark.parametrize("named, context", list(CASES.values()), ids=list(CASES))
def test_a_constructor_naming_a_device_replays_bitwise_the_eager_cpu_build(named, context):
    torch.manual_seed(7)
    with annot.meta_init(), (torch.device(context) if context else contextlib.nullcontext()):
        model = TwoLayers(named)
    annot.materialize(model)
    expected, got = _values(_eager(7)), _values(model)
    assert {n: t.device.type for n, t in got.items()} == dict.fromkeys(expected, "cpu")
    assert [n for n in expected if not torch.equal(expected[n], got[n])] == []


def test_the_record_keeps_the_device_the_constructor_named():
    with annot.meta_init():
        model = TwoLayers("cuda")
    record = deferred_init_of(model)
    assert record is not None
    named = {op.named_device for op in record.ops if op.named_device is not None}
    assert named == {torch.device("cuda")}


def test_meta_device_init_with_a_cuda_constructor_allocates_nothing_and_replays_bitwise():
    torch.manual_seed(3)
    with meta_device_init():
        model = TwoLayers("cuda")
    assert all(t.is_meta for t in _values(model).values())
    annot.materialize(model)
    expected, got = _values(_eager(3)), _values(model)
    assert [n for n in expected if not torch.equal(expected[n], got[n])] == []
