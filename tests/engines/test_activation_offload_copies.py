"""Activation offload's copies, on the CPU path the GPU path shares: the tensors handed
to the host are released by the graph, parameter casts under autocast stay, host buffers
are reused between steps, backward copies the previous unit back ahead of time, and the
numbers equal a run without offload (bitwise)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from annot.runtime.activation_offload import (
    ActivationOffloader,
    apply_activation_offload,
    parameter_derived,
)

WIDTH, LAYERS = 64, 4
BLOCKS = [str(i) for i in range(LAYERS)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(LAYERS)))


def batch() -> torch.Tensor:
    return torch.randn(8, 16, WIDTH, generator=torch.Generator().manual_seed(1))


def offloaded(paths=BLOCKS) -> tuple[nn.Sequential, ActivationOffloader]:
    model = stack()
    offloader = apply_activation_offload(model, paths)
    assert offloader is not None
    return model, offloader


def step(model: nn.Module, autocast: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(batch()).float().square().mean()
    loss.backward()
    return loss


def assert_same_step(model: nn.Module, bare: nn.Module, autocast: bool = False) -> None:
    loss, loss_bare = step(model, autocast), step(bare, autocast)
    assert loss.item() == loss_bare.item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_offloaded_tensors_are_released_by_the_graph():
    """What the pack hook copies is no longer held by autograd: at least 0.8 x the
    offloaded bytes are freed when the forward returns (the GPU row's bound)."""
    model, offloader = offloaded()
    originals: list[tuple[weakref.ref, int]] = []
    pack = offloader.pack

    def recording_pack(tensor):
        packed = pack(tensor)
        if packed is not tensor:
            originals.append((weakref.ref(tensor), tensor.nbytes))
        return packed

    offloader.pack = recording_pack
    loss = model(batch()).square().mean()
    gc.collect()
    freed = sum(nbytes for ref, nbytes in originals if ref() is None)
    assert offloader.packed_bytes > 0
    assert freed >= 0.8 * offloader.packed_bytes
    loss.backward()


def test_autocast_weight_casts_stay_and_activations_go():
    """Under bf16 autocast a Linear saves autocast's cached bf16 cast of its weight:
    that is kept (identified by value against the weight cast by hand), the rest moves."""
    model, offloader = offloaded()
    kept, moved = [], []
    pack = offloader.pack

    def recording_pack(tensor):
        packed = pack(tensor)
        (kept if packed is tensor else moved).append(tensor)
        return packed

    offloader.pack = recording_pack
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch()).float().square().mean().backward()
    weights = [m.weight.detach().to(torch.bfloat16) for m in model.modules() if isinstance(m, nn.Linear)]

    def is_weight(t: torch.Tensor) -> bool:
        return any(t.shape in (w.shape, w.t().shape) and t.dtype == w.dtype
                   and torch.equal(t.reshape(w.shape) if t.shape == w.shape else t.t(), w)
                   for w in weights)

    assert sum(map(is_weight, kept)) >= len(weights)  # every Linear's cast weight kept
    assert not any(map(is_weight, moved))
    assert offloader.packed_tensors == len(moved) > 0


def test_an_input_cast_is_offloaded_and_a_parameter_cast_is_not():
    weight = nn.Parameter(torch.randn(4, 4))
    leaf_input = torch.randn(4, 4, requires_grad=True)
    assert parameter_derived(weight.to(torch.bfloat16).t())
    assert not parameter_derived(leaf_input.to(torch.bfloat16))
    assert not parameter_derived((weight * 2).to(torch.bfloat16))  # computed, not a cast


def test_autocast_numbers_equal_no_offload():
    (model, offloader), bare = offloaded(), stack()
    assert_same_step(model, bare, autocast=True)
    assert offloader.packed_tensors > 0


def test_host_buffers_are_reused_from_step_to_step():
    model, offloader = offloaded()
    step(model)
    made = offloader.buffers_made
    offloader.reset_counters()
    step(model)
    assert offloader.buffers_made == made
    assert offloader.buffers_reused == offloader.packed_tensors > 0


def test_backward_copies_the_previous_unit_back_ahead_of_time():
    """Every unit but the last one backward reaches is copied back before backward
    reads it: the prefetch counter holds all tensors except the last unit's."""
    _, last_only = offloaded(BLOCKS[-1:])
    step(_)
    model, offloader = offloaded()
    step(model)
    assert offloader.unpacked_tensors == offloader.packed_tensors
    assert offloader.prefetched_tensors == offloader.packed_tensors - last_only.packed_tensors > 0


def test_a_retained_graph_reads_its_host_copies_twice():
    (model, offloader), bare = offloaded(), stack()
    for net in (model, bare):
        loss = net(batch()).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert offloader.unpacked_tensors == 2 * offloader.packed_tensors > 0
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
