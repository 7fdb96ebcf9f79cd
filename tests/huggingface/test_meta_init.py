"""Every architecture of the matrix built under `annot.meta_init` and materialized equals
eager construction bitwise (parameters and buffers, non-persistent ones included).

This covers two things transformers models need from the recorder: torch 2.13's
rejection-sampling ``trunc_normal_`` (ViT's init; value-dependent, so recorded as one
opaque operation) and scalar constants made by ``torch.tensor(x)`` in a constructor
(Gemma's ``embed_scale``), which reach the record only as fake tensors.

Built on the meta device instead (`meta_device_init`, what `from_pretrained` tries
first): every non-persistent buffer the tape computes is eager's, and the one it cannot
compute is reported (docs/design.md, pitfall 29)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import annot
from annot.meta.deferred import DeferredInitError, deferred_init_of, meta_device_init
from annot.meta.materialization import materialize
from tests.huggingface.hf_archs import ARCHS, BUFFER_VARIANTS, SEED, buffer_variant


def _everything(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(ARCHS))
def test_materialized_equals_eager(name):
    arch = ARCHS[name]
    eager = arch.build()
    torch.manual_seed(SEED)
    with annot.meta_init():
        deferred = arch.model_cls()(arch.config())
    assert all(t.is_meta for t in _everything(deferred).values())
    annot.materialize(deferred)
    expected, actual = _everything(eager), _everything(deferred)
    assert set(actual) == set(expected)
    assert [n for n in expected if not torch.equal(expected[n], actual[n])] == []


def test_trunc_normal_outside_meta_init_is_torch_own():
    """The patch is active only inside the block."""
    torch.manual_seed(1)
    a = torch.nn.init.trunc_normal_(torch.empty(1000), std=0.5)
    with annot.meta_init():
        torch.nn.Linear(2, 2)
    torch.manual_seed(1)
    b = torch.nn.init.trunc_normal_(torch.empty(1000), std=0.5)
    assert torch.equal(a, b) and a.abs().max() <= 2.0


# A literal made by torch.tensor(x) on the meta device keeps no value: the first
# operation reading it is refused (Gemma's embed_scale, Phi-3's long-rope factors).
REFUSED_ON_THE_META_DEVICE = {"gemma", "gemma3", "phi3_longrope"}


def _model_and_build(name: str) -> tuple[type, Any]:
    if name in ARCHS:
        return ARCHS[name].model_cls(), ARCHS[name].config()
    return buffer_variant(name)


@pytest.mark.parametrize("name", [*ARCHS, *BUFFER_VARIANTS])
def test_meta_device_build_computes_non_persistent_buffers_as_eager(name):
    """What a checkpoint cannot supply (non-persistent buffers: rotary frequencies,
    position ids) comes from the tape, bitwise eager's, or the build is refused."""
    cls, config = _model_and_build(name)
    torch.manual_seed(SEED)
    eager = cls(config)
    if name in REFUSED_ON_THE_META_DEVICE:
        with pytest.raises(DeferredInitError, match="no recorded operation made"), meta_device_init():
            cls(config)
        return
    with meta_device_init():
        deferred = cls(config)
    record = deferred_init_of(deferred)
    assert record is not None and record.on_meta_device
    persistent = set(deferred.state_dict())
    assert set(record.uninitialized()) <= persistent
    materialize(deferred, skip=persistent)  # the persistent ones are the checkpoint's
    expected, actual = dict(eager.named_buffers()), dict(deferred.named_buffers())
    computed = set(actual) - persistent
    assert [n for n in computed if not torch.equal(expected[n], actual[n])] == []


@pytest.mark.parametrize("use", ["copied", "in_place", "viewed"])
def test_a_meta_tensor_no_recorded_operation_made_is_refused(use):
    """Read by an operation, written in place, or viewed: each would leave the replay
    without a value to start from."""
    outside = torch.ones(3, device="meta")
    with pytest.raises(DeferredInitError, match="no recorded operation made"), meta_device_init():
        layer = torch.nn.Linear(3, 3)
        with torch.no_grad():
            if use == "copied":
                layer.bias.copy_(outside)
            elif use == "in_place":
                outside.mul_(3)
            else:
                layer.register_buffer("scale", outside.view(3) * 2, persistent=False)


class _FilledOffMeta(torch.nn.Module):
    """Fills its buffer only off the meta device, as transformers' ``_init_weights`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(3), persistent=False)
        if self.table.device.type != "meta":
            self.table.fill_(1.0)


def test_a_buffer_left_unwritten_on_the_meta_device_is_reported():
    """`from_pretrained` keeps a meta-device build only if this set is empty."""
    with meta_device_init():
        on_meta = _FilledOffMeta()
    with annot.meta_init():
        on_fake = _FilledOffMeta()
    assert deferred_init_of(on_meta).uninitialized() == ["table"]
    assert deferred_init_of(on_fake).uninitialized() == []
