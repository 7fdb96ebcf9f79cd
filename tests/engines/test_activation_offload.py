"""Activation offload, counted in one process: what autograd saves inside offloaded units
goes through the pack hook to the host, comes back in backward, and changes no number."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import annot
from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.runtime.activation_offload import (
    ActivationOffloader,
    activation_offloader,
    apply_activation_offload,
    offload_activations,
    offloaded_activation_paths,
)
from examples.gpt.model import GPT
from tests.engines.small_gpt import N_LAYER, RecomputeCounter, gpt, tokens

BLOCKS = [f"transformer.h.{i}" for i in range(N_LAYER)]


def offloaded_gpt(paths=BLOCKS) -> tuple[GPT, ActivationOffloader]:
    model = gpt()
    return model, apply_activation_offload(model, paths)


def plain_saved_bytes(model: GPT) -> int:
    """Bytes of saved tensors outside parameter memory that reach the outermost
    saved-tensor hooks in one forward: inner hooks, such as the offloaded units', take
    theirs first."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = 0

    def count(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        if tensor.untyped_storage().data_ptr() not in params:
            seen += tensor.nbytes
        return tensor

    idx = tokens(model)
    with saved_tensors_hooks(count, lambda t: t):
        model(idx, idx)
    return seen


def test_what_offloaded_blocks_save_goes_through_the_pack_hook_to_the_host():
    bare = plain_saved_bytes(gpt())
    model, offloader = offloaded_gpt()
    outside_blocks = plain_saved_bytes(model)
    # Every saved byte lands in exactly one place: the blocks' in the offloader.
    assert outside_blocks + offloader.packed_bytes == bare
    assert offloader.packed_bytes > bare / 2  # the blocks hold most activations


def test_packed_tensors_are_host_copies_that_backward_reads():
    model, offloader = offloaded_gpt()
    copies = []
    pack = offloader.pack

    def recording_pack(tensor):
        packed = pack(tensor)
        if not isinstance(packed, torch.Tensor):  # a host copy, not a parameter left alone
            copies.append((tensor, packed))
        return packed

    offloader.pack = recording_pack  # the hooks look it up on each unit's forward
    idx = tokens(model, batch=2)
    _, loss = model(idx, idx)
    assert copies and offloader.packed_tensors == len(copies)
    for original, packed in copies:
        assert packed.tensor.device.type == "cpu"
        assert packed.tensor.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
        torch.testing.assert_close(packed.tensor, original.detach(), rtol=0, atol=0)
        packed.tensor.zero_()  # if backward reads the copies, the gradients must change
    loss.backward()
    assert offloader.unpacked_tensors == offloader.packed_tensors
    bare = gpt()
    RecomputeCounter(bare).step(bare)
    changed = [n for (n, p), q in zip(model.named_parameters(), bare.parameters(), strict=True)
               if not torch.equal(p.grad, q.grad)]
    assert "transformer.h.0.mlp.c_fc.weight" in changed


def test_loss_and_gradients_equal_the_bare_model():
    bare, (model, offloader) = gpt(), offloaded_gpt()
    loss_bare, loss = RecomputeCounter(bare).step(bare), RecomputeCounter(model).step(model)
    assert offloader.packed_tensors > 0
    assert loss.item() == loss_bare.item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_parameters_are_not_copied():
    model, offloader = offloaded_gpt()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []
    pack = offloader.pack
    offloader.pack = lambda t: seen.append(t) or pack(t)
    model(tokens(model), tokens(model))
    assert any(t.untyped_storage().data_ptr() in params for t in seen)  # weights and their views
    host_copies = [t for t in seen if t.untyped_storage().data_ptr() not in params]
    assert offloader.packed_tensors == len(host_copies)


def test_a_checkpointed_and_offloaded_unit_offloads_exactly_its_input():
    """The checkpoint keeps only each block's input, and that goes to the host; the
    recomputation reads it back, and the numbers stay the bare model's."""
    bare, (model, offloader) = gpt(), offloaded_gpt()
    apply_checkpointing(model, BLOCKS)
    counter = RecomputeCounter(model)
    idx = tokens(model, batch=2)
    block_input_bytes = idx.numel() * model.config.n_embd * 4  # (batch, length, n_embd) fp32
    loss, loss_bare = counter.step(model), RecomputeCounter(bare).step(bare)
    assert (offloader.packed_tensors, offloader.packed_bytes) == (N_LAYER, N_LAYER * block_input_bytes)
    assert offloader.unpacked_tensors == N_LAYER
    assert counter.backward_calls == N_LAYER
    assert loss.item() == loss_bare.item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_offload_nested_in_a_checkpointed_unit_leaves_the_recomputation_alone():
    bare, (model, offloader) = gpt(), offloaded_gpt([f"{b}.mlp" for b in BLOCKS])
    apply_checkpointing(model, BLOCKS)
    counter = RecomputeCounter(model)
    loss, loss_bare = counter.step(model), RecomputeCounter(bare).step(bare)
    assert offloader.packed_tensors == 0  # never pushed over the checkpoint's hooks
    assert counter.backward_calls == N_LAYER
    assert loss.item() == loss_bare.item()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class _ScaledByHostScalar(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mul saves the 0-dim CPU tensor for x's gradient, as CUDA's attention kernels
        # save their CPU seed and offset.
        return x * torch.tensor(2.0)


def test_a_host_tensor_saved_by_a_call_on_another_device_stays_where_it_is():
    """The meta device stands in for a GPU: the first GPU run packed SDPA's CPU seed into
    a pageable buffer. A CPU tensor is offloaded only when the call computes on the CPU."""
    module = _ScaledByHostScalar()
    offloader = offload_activations(module)
    module(torch.ones(3, device="meta", requires_grad=True)).sum().backward()
    assert offloader.packed_tensors == 0
    module(torch.ones(3, requires_grad=True)).sum().backward()
    assert offloader.packed_tensors == 1


def test_nothing_is_offloaded_without_autograd():
    model, offloader = offloaded_gpt()
    with torch.no_grad():
        model(tokens(model))
    assert offloader.packed_tensors == 0


def test_a_forward_that_raises_leaves_no_hooks_behind():
    model, _ = offloaded_gpt()
    too_long = torch.zeros(1, model.config.block_size, model.config.n_embd + 1)
    with pytest.raises(RuntimeError):
        model.transformer.h[0](too_long)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_names_unchanged_and_one_offloader_per_model():
    bare, (model, offloader) = gpt(), offloaded_gpt()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in bare.named_parameters()]
    assert list(model.state_dict()) == list(bare.state_dict())
    assert activation_offloader(model) is offloader and activation_offloader(bare) is None
    with pytest.raises(ValueError, match="already offloaded"):
        offload_activations(model.transformer.h[0])


@pytest.mark.parametrize(("choice", "expected"), [(None, ["transformer.h.1"]), (True, BLOCKS), (False, [])])
def test_offloaded_paths_follow_the_plan_or_override_it(choice, expected):
    model = gpt()
    annot.mark(model.transformer.h[1], offload="cpu")
    assert offloaded_activation_paths(annot.plan(model), choice) == expected


@pytest.mark.distributed
def test_ddp_reads_the_plans_offload_mark_as_activation_offload(one_rank):
    model = gpt()
    annot.mark(model.transformer.h[1], offload="cpu")
    annot.auto_wrap(model, "ddp", checkpoint=False)
    offloader = activation_offloader(model)
    model(tokens(model), tokens(model))
    assert activation_offloader(model.transformer.h[1]) is offloader
    assert [activation_offloader(model.transformer.h[i]) for i in (0, 2, 3)] == [None] * 3
    assert offloader.packed_tensors > 0


@pytest.mark.distributed
def test_fsdp2_offload_marks_stay_parameter_offload(one_rank):
    model = gpt()
    annot.mark(model.transformer.h[1], offload="cpu")
    annot.auto_wrap(model, "fsdp2", checkpoint=False)
    assert activation_offloader(model) is None
    annot.auto_wrap(m := gpt(), "fsdp2", checkpoint=False, offload_activations=True)
    assert all(activation_offloader(m.transformer.h[i]) is not None for i in range(N_LAYER))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_activations_wait_in_pinned_host_memory_and_numbers_hold():
    bare, (model, offloader) = gpt().cuda(), offloaded_gpt()
    model.cuda()
    held = []
    pack = offloader.pack
    offloader.pack = lambda t: held.append(pack(t)) or held[-1]
    idx = tokens(model).cuda()
    _, loss = model(idx, idx)
    _, loss_bare = bare(idx, idx)
    copies = [h for h in held if not isinstance(h, torch.Tensor)]
    assert copies
    assert [c.device.type for c in copies] == ["cuda"] * len(copies)
    assert all(c.tensor.is_pinned() for c in copies)
    loss.backward()
    loss_bare.backward()
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
