"""Activation offload: what autograd saves for backward inside a unit waits on the host.

Two different things are called "offload" in annot; this module is the first:

- **activation offload** (here; ``auto_wrap(..., offload_activations=...)``, and what a
  Plan's offload mark means for DDP): tensors autograd saves during a unit's forward
  are copied to host memory when saved and copied back to their device when backward
  needs them. Parameters stay where the engine keeps them.
- **parameter offload** (FSDP2's ``CPUOffloadPolicy``, FSDP1's ``CPUOffload``,
  DeepSpeed's ``offload_param``/``offload_optimizer``; ``auto_wrap(..., offload=...)``):
  parameters, gradients and optimizer state live on the host. DeepSpeed offloads its
  activation checkpoints itself (``deepspeed_config(cpu_checkpointing=True)``).

`offload_activations` registers a forward pre-hook and an always-called forward hook on
a module; they push and pop `torch.autograd.graph.saved_tensors_hooks` around its
forward. Nothing wraps the module, so parameter and ``state_dict`` names stay the bare
model's.

What the pack hook does (issue #30; docs/design.md, pitfall 45: torch's ``save_on_cpu``
copies on the compute stream, into new host memory each time, with no prefetch):

- **What stays**: parameters, views of them, and what autograd reached from a parameter
  through views and casts alone (`parameter_derived`): under ``torch.autocast`` a bf16
  weight is a cast of the fp32 parameter, cached by autocast for the whole forward, so
  copying it to the host frees nothing and costs a weight-sized copy per use (DDP and
  FSDP1 train under autocast; FSDP2's gathered parameters are themselves parameters).
  Also left: tensor subclasses such as ``DTensor`` and non-strided layouts. A frozen
  parameter's cast is not cached by autocast (it is made for one operation and only
  the saved graph holds it), so it is offloaded like an activation.
- **Where it goes**: a host buffer from a pool that reuses buffers between steps
  (`annot.runtime.host_buffers`), pinned within the rank's budget
  (`annot.host_memory`), filled on a side CUDA stream (`annot.runtime.offload_copies`):
  the copy overlaps the next operations, and autograd's reference to the GPU tensor is
  dropped at once (the allocator keeps its memory for the side stream until read).
- **Coming back**: the tensors a unit call saved form one group. When backward first
  reads one of a group, the whole group is copied back, and so is the group of the unit
  called before it (the next one backward reaches): that copy overlaps this unit's
  backward. The current stream waits for a tensor's copy only when backward reads it.
  A host buffer returns to the pool when autograd frees the saved tensor (after
  backward, or when the graph is dropped), so ``retain_graph=True`` reads it again.

On a CPU device the same code runs with copies made at once and no stream: it saves no
memory there, and is kept so that CPU runs exercise the same grouping, prefetch, buffer
reuse and counters as GPU runs (the tests rely on it).

With checkpointing on the same unit, the offload hooks sit around the unit's call and the
checkpoint inside it, so the two combine: the checkpoint keeps only the unit's inputs,
saved through autograd (torch's non-reentrant checkpoint before its own hooks take over,
DeepSpeed's reentrant one in ``save_for_backward``), and those go to the host; the rest
is recomputed in backward, and the recomputation reads the inputs back from the host.
The hooks are never pushed under another checkpoint or during a recomputation in
backward (see `annot.runtime.autograd_state`): there they would keep on the host what the
checkpoint drops.

The two hooks are ``torch.compiler.disable``-d: with ``block.compile(fullgraph=True)``
dynamo starts at the block's forward, the hooks run eagerly around it, and what the
compiled region saves for backward goes through them (0 graph breaks). Compiling a
parent instead inlines the block's hooks and stops there: dynamo runs the parent's
forward eagerly (its block loop cannot resume after a break) and compiles each block's
forward on its own; ``fullgraph=True`` on the parent fails.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from annot.module_state import module_state, peek_state
from annot.policies import Action, Plan
from annot.runtime.autograd_state import under_outer_checkpoint
from annot.runtime.host_buffers import HostBufferPool
from annot.runtime.offload_copies import Copier, copier_for
from annot.runtime.units import unit_paths

__all__ = [
    "ActivationOffloader",
    "activation_offloader",
    "apply_activation_offload",
    "offload_activations",
    "offloaded_activation_paths",
    "parameter_derived",
]

# Autograd nodes that only reshape, slice or cast their one input: a tensor reached from
# a parameter through these alone holds the parameter's values (autocast's bf16 weight
# is ToCopyBackward0 of it, a Linear saves its transpose, FSDP1's views split its flat
# parameter).
_VIEW_OR_CAST_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
    "ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "AsStridedBackward0", "SliceBackward0", "SelectBackward0", "SplitBackward0",
    "SplitWithSizesBackward0",
})
_MAX_VIEW_CHAIN = 8


def parameter_derived(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter, a view of one, or reached from one by autograd
    through views and casts alone (an autocast weight cast and its transpose). Only
    trainable parameters leave the last kind of trace (frozen ones have no graph)."""
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
        return True
    node = tensor.grad_fn
    for _ in range(_MAX_VIEW_CHAIN):
        if node is None:
            return False
        if hasattr(node, "variable"):  # AccumulateGrad: the leaf the chain starts from
            return isinstance(node.variable, nn.Parameter)
        if type(node).__name__ not in _VIEW_OR_CAST_NODES:
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def _offloadable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor  # not a Parameter, DTensor or other subclass
        and tensor.layout == torch.strided
        # Empty: nothing to free (torch 2.11's checkpoint saves an empty stand-in beside
        # the unit's inputs, which the first run on 2.11 counted as offloaded).
        and tensor.numel() > 0
        and not parameter_derived(tensor)
    )


def _first_tensor_device(args: Any) -> torch.device | None:
    return next((a.device for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)


def _already_on_host(tensor: torch.Tensor, group: _Group) -> bool:
    """A CPU tensor saved by a call that computes on an accelerator (the random seed
    and offset CUDA's attention kernels save for backward): it is on the host already,
    and a copy would gain nothing. On a CPU run every tensor is offloaded, so that the
    CPU tests exercise the same path."""
    return tensor.device.type == "cpu" and group.device is not None and group.device.type != "cpu"


class _Group:
    """The tensors one call of an offloaded unit saved, and the group of the unit called
    before it (weakly: autograd frees each group's tensors with its part of the graph)."""

    __slots__ = ("__weakref__", "copies", "device", "fetched", "previous")

    def __init__(self, previous: _Group | None, device: torch.device | None) -> None:
        self.copies: list[weakref.ref[_HostCopy]] = []
        # Where the call computes (its first tensor input's device; None: no tensor input).
        self.device = device
        self.fetched = False
        self.previous = weakref.ref(previous) if previous is not None else None


class _HostCopy:
    """A saved tensor's copy on the host (``tensor``: a view of a pooled buffer), the
    device it goes back to, and its copy back while one is under way."""

    __slots__ = ("__weakref__", "device", "group", "on_device", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device, group: _Group) -> None:
        self.tensor = tensor
        self.device = device
        self.group = group
        self.on_device: tuple[torch.Tensor, Any] | None = None


def _view_as(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``buffer`` (flat bytes) seen as a contiguous tensor of ``like``'s dtype and size."""
    return buffer.view(like.dtype).view(like.size())


class ActivationOffloader:
    """The pack/unpack hooks shared by one model's offloaded units, with counters.

    ``packed_tensors``/``packed_bytes`` count the tensors (and their bytes) copied to
    the host when saved; ``unpacked_tensors`` those brought back in backward;
    ``prefetched_tensors`` those whose copy back started before backward reached their
    unit (the prefetch of the unit called before the one backward is in). A unit's
    forward run under another checkpoint, in backward, or with autograd off pushes no
    hooks and counts nothing. ``buffers_made``/``buffers_reused``: host buffers
    allocated, and requests the pool served again.
    """

    def __init__(self) -> None:
        self.packed_tensors = 0
        self.packed_bytes = 0
        self.unpacked_tensors = 0
        self.prefetched_tensors = 0
        # (module, hooks or None, its group or None) per unit call in progress, innermost last.
        self._calls: list[tuple[nn.Module, saved_tensors_hooks | None, _Group | None]] = []
        self._last_group: weakref.ref[_Group] | None = None
        self._pools: dict[bool, HostBufferPool] = {}
        self._copiers: dict[torch.device, Copier] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> ActivationOffloader:
        # A copied model gets its own hooks' state; buffers and CUDA streams are not copied.
        return ActivationOffloader()

    @property
    def buffers_made(self) -> int:
        return sum(pool.made for pool in self._pools.values())

    @property
    def buffers_reused(self) -> int:
        return sum(pool.reused for pool in self._pools.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _HostCopy:
        # The innermost call that pushed hooks: ours are on top whenever this runs.
        group = next((g for _, _, g in reversed(self._calls) if g is not None), None)
        if group is None or not _offloadable(tensor) or _already_on_host(tensor, group):
            return tensor
        pool = self._pool(pin=tensor.device.type == "cuda")
        buffer = pool.take(tensor.nbytes)
        host = _view_as(buffer, tensor)
        self._copier(tensor.device).to_host(tensor.detach(), host)
        copy = _HostCopy(host, tensor.device, group)
        # The buffer goes back to the pool when autograd frees the saved tensor.
        weakref.finalize(copy, pool.give_back, buffer)
        group.copies.append(weakref.ref(copy))
        self.packed_tensors += 1
        self.packed_bytes += host.nbytes
        return copy

    def unpack(self, packed: torch.Tensor | _HostCopy) -> torch.Tensor:
        if not isinstance(packed, _HostCopy):
            return packed
        self.unpacked_tensors += 1
        group = packed.group
        self._fetch(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None and not previous.fetched:
            self.prefetched_tensors += self._fetch(previous)
        copier = self._copier(packed.device)
        if packed.on_device is None:  # read again (retain_graph=True): copy it once more
            packed.on_device = copier.to_device(packed.tensor, packed.device)
        tensor, ready = packed.on_device
        packed.on_device = None  # backward holds it from here; we must not
        copier.wait(ready)
        return tensor

    def reset_counters(self) -> None:
        self.packed_tensors = self.packed_bytes = self.unpacked_tensors = 0
        self.prefetched_tensors = 0

    def _fetch(self, group: _Group) -> int:
        """Start copying back every tensor of ``group`` still saved; how many."""
        if group.fetched:
            return 0
        group.fetched = True
        started = 0
        for ref in group.copies:
            copy = ref()
            if copy is not None and copy.on_device is None:
                copy.on_device = self._copier(copy.device).to_device(copy.tensor, copy.device)
                started += 1
        return started

    def _pool(self, *, pin: bool) -> HostBufferPool:
        if pin not in self._pools:
            self._pools[pin] = HostBufferPool(pin=pin)
        return self._pools[pin]

    def _copier(self, device: torch.device) -> Copier:
        if device not in self._copiers:
            self._copiers[device] = copier_for(device)
        return self._copiers[device]

    def _enter(self, module: nn.Module, _args: Any) -> None:
        hooks, group = None, None
        if torch.is_grad_enabled() and not under_outer_checkpoint():
            previous = self._last_group() if self._last_group is not None else None
            group = _Group(previous, _first_tensor_device(_args))
            self._last_group = weakref.ref(group)
            hooks = saved_tensors_hooks(self.pack, self.unpack)
            hooks.__enter__()
        self._calls.append((module, hooks, group))

    def _exit(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # Always called, also when the forward raised; but if an earlier pre-hook raised,
        # `_enter` never ran for this call and there is nothing of ours to pop.
        if not self._calls or self._calls[-1][0] is not module:
            return
        _, hooks, _ = self._calls.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)


@functools.cache
def _eager_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """The offloader's hooks kept out of torch.compile (see the module docstring):
    pushing saved-tensor hooks and the outer-checkpoint test cannot be traced. Made on
    first use, because ``torch.compiler.disable`` imports dynamo (seconds)."""
    disable = torch.compiler.disable
    return disable(ActivationOffloader._enter), disable(ActivationOffloader._exit)


def offload_activations(
    module: nn.Module, offloader: ActivationOffloader | None = None
) -> ActivationOffloader:
    """Offload what autograd saves during ``module``'s forward to the host (in place).

    Returns the offloader (a new one unless given), whose counters show what moved.
    Offloading a module twice is an error rather than a second set of hooks.
    """
    state = module_state(module)
    if state.activation_offloader is not None:
        raise ValueError(f"{type(module).__name__}'s activations are already offloaded by annot")
    offloader = offloader if offloader is not None else ActivationOffloader()
    enter, exit_ = _eager_hooks()
    # Bound methods, so copy.deepcopy rebinds them to the copy's offloader.
    module.register_forward_pre_hook(types.MethodType(enter, offloader))
    module.register_forward_hook(types.MethodType(exit_, offloader), always_call=True)
    state.activation_offloader = offloader
    return offloader


def activation_offloader(model: nn.Module) -> ActivationOffloader | None:
    """The offloader of the first module of ``model`` whose activations are offloaded
    (one per model when `apply_activation_offload` set them up), or ``None``."""
    for module in model.modules():
        state = peek_state(module)
        if state is not None and state.activation_offloader is not None:
            return state.activation_offloader
    return None


def offloaded_activation_paths(plan: Plan, offload_activations: bool | None) -> list[str]:
    """Module paths whose activations to offload: the units the Plan marks offload
    (``None``), every unit (``True``) or none (``False``)."""
    return unit_paths(plan, Action.OFFLOAD, offload_activations)


def apply_activation_offload(
    model: nn.Module, paths: Iterable[str]
) -> ActivationOffloader | None:
    """Offload the activations of the modules of ``model`` at ``paths``, all through one
    offloader (returned; ``None`` when ``paths`` is empty)."""
    offloader = None
    for path in paths:
        offloader = offload_activations(model.get_submodule(path), offloader)
    return offloader
