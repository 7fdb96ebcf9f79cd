"""Markers only attach metadata: the class behaves exactly as before."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from annot import checkpoint_block, get_mark, mark, offload_block, shard_block, unmark
from annot.policies import Mark


def _block_class(decorate):
    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) * self.scale

    return decorate(Blk) if decorate else Blk


# Module-level classes so pickle can find them by name.
class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


@shard_block(checkpoint=True, offload="cpu")
class Marked(Plain):
    pass


def test_decorated_class_forward_state_dict_and_repr_unchanged():
    torch.manual_seed(0)
    plain = _block_class(None)()
    torch.manual_seed(0)
    marked_ = _block_class(shard_block(checkpoint=True))()
    x = torch.randn(3, 4)
    assert torch.equal(plain(x), marked_(x))
    assert list(plain.state_dict()) == list(marked_.state_dict())
    assert repr(plain) == repr(marked_)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in marked_.named_parameters()]


def test_decorated_module_pickles_and_keeps_its_mark():
    module = Marked()
    clone = pickle.loads(pickle.dumps(module))
    x = torch.randn(2, 4)
    assert torch.equal(module(x), clone(x))
    assert get_mark(clone) == Mark(shard=True, checkpoint=True, offload="cpu")


def test_instance_mark_survives_pickling():
    module = Plain()
    mark(module, checkpoint=True)
    clone = pickle.loads(pickle.dumps(module))
    assert get_mark(clone).checkpoint is True


def test_decorated_module_compiles_like_the_plain_one():
    torch.manual_seed(0)
    module = Marked()
    x = torch.randn(2, 4)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), module(x))


def test_bare_and_called_forms():
    assert get_mark(_block_class(shard_block)()) == Mark(shard=True)
    assert get_mark(_block_class(checkpoint_block)()) == Mark(checkpoint=True)
    assert get_mark(_block_class(offload_block)()) == Mark(offload="cpu")
    assert get_mark(_block_class(offload_block(to="nvme"))()) == Mark(offload="nvme")
    assert get_mark(_block_class(shard_block(offload=True))()) == Mark(shard=True, offload="cpu")


def test_stacked_decorators_merge():
    cls = checkpoint_block(shard_block(_block_class(None)))
    assert {a.value for a in get_mark(cls()).actions()} == {"shard", "checkpoint"}
    assert get_mark(cls()) == Mark(shard=True, checkpoint=True)


def test_subclass_inherits_and_overrides():
    @shard_block(checkpoint=True)
    class Base(Plain):
        pass

    class Child(Base):
        pass

    @checkpoint_block(enabled=False)
    class NoCkpt(Base):
        pass

    @shard_block(enabled=False)
    class Unsharded(Base):
        pass

    assert get_mark(Child()) == Mark(shard=True, checkpoint=True)
    assert get_mark(NoCkpt()) == Mark(shard=True, checkpoint=False)
    assert get_mark(Unsharded()) == Mark(shard=False, checkpoint=True)
    assert get_mark(Base()) == Mark(shard=True, checkpoint=True)  # parent untouched


def test_mark_foreign_class_and_instance_then_unmark():
    cls = _block_class(None)  # stands in for a class we do not own
    mark(cls, shard=True)
    first, second = cls(), cls()
    mark(second, shard=False, checkpoint=True)  # per instance, over the class mark
    assert get_mark(first) == Mark(shard=True)
    assert get_mark(second) == Mark(shard=False, checkpoint=True)
    unmark(second)
    assert get_mark(second) == Mark(shard=True)
    unmark(cls)
    assert get_mark(first) == Mark()


def test_markers_reject_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        shard_block(int)
    with pytest.raises(TypeError, match="nn.Module"):
        mark(object(), shard=True)  # type: ignore[arg-type]


def test_bad_offload_target_is_rejected():
    with pytest.raises(ValueError, match="offload must be one of"):
        offload_block(to="disk")
