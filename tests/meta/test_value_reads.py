"""A constructor that reads a value it computed (``.item()`` on a ``linspace``, as CvT's
stages do for their drop-path rates) builds under `annot.meta_init` with the value eager
construction reads, and its parameters replay bitwise; a read of a value the deferred
build cannot know (a random weight's) is refused in annot's words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.meta.deferred import DeferredInitError, meta_device_init
from annot.meta.materialization import materialize


class ReadsRates(nn.Module):
    """Sizes and rates read from tensors the constructor made, as CvT does."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.3, 4, device="cpu")]
        scale = torch.ones(3)
        scale.mul_(2.5)  # an in-place write on the chain the read replays
        self.scale = float(scale[1])
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(int(torch.arange(5).sum()), 2)
        # A weight larger than the read limit, scaled by the table before the table is
        # read: an operation that only reads the table is not on the read's chain.
        table = torch.linspace(1, 2, 3)
        self.wide = nn.Linear(300, 300)
        with torch.no_grad():
            self.wide.weight.mul_(table[0])
        self.last = table[2].item()


class ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = self.proj.weight.abs().sum().item()


@pytest.mark.parametrize("block", [annot.meta_init, meta_device_init])
def test_values_read_in_the_constructor_are_eager_ones(block) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    eager = ReadsRates()
    torch.manual_seed(0)
    with block():
        deferred = ReadsRates()
    assert deferred.rates == eager.rates
    assert deferred.scale == eager.scale == 2.5
    assert deferred.second.in_features == 10
    assert deferred.last == eager.last == 2.0
    materialize(deferred)
    for name, tensor in eager.state_dict().items():
        assert torch.equal(deferred.state_dict()[name], tensor), name


def test_a_read_of_a_random_weight_is_refused() -> None:
    with pytest.raises(DeferredInitError, match="reads a tensor's value"), annot.meta_init():
        ReadsWeight()
