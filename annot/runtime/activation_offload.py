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
model's. The pack hook copies into a fresh host tensor (pinned, copied without blocking,
when the tensor is on CUDA) and remembers the device; the unpack hook copies it back.
Left where they are, and not counted: parameters and views of them (FSDP2's gathered
ones included: the engine owns their memory), tensor subclasses such as ``DTensor``, and non-strided layouts.
On a CPU device the copy is a plain clone: it saves no memory there, and is kept so that
CPU runs exercise the same round trip as GPU runs (the counters and tests rely on it).

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

import dataclasses
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from annot.module_state import module_state, peek_state
from annot.policies import Action, Plan
from annot.runtime.autograd_state import under_outer_checkpoint
from annot.runtime.units import unit_paths

__all__ = [
    "ActivationOffloader",
    "activation_offloader",
    "apply_activation_offload",
    "offload_activations",
    "offloaded_activation_paths",
]


@dataclasses.dataclass(frozen=True)
class _HostCopy:
    """A saved tensor's copy on the host and the device it goes back to."""

    tensor: torch.Tensor
    device: torch.device


def _offloadable(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor  # not a Parameter, DTensor or other subclass
        and tensor.layout == torch.strided
        # A view of a parameter (a Linear saves ``weight.t()``) is the parameter's memory.
        and not isinstance(tensor._base, nn.Parameter)
    )


class ActivationOffloader:
    """The pack/unpack hooks shared by one model's offloaded units, with counters.

    ``packed_tensors``/``packed_bytes`` count the tensors (and their bytes) copied to
    the host when saved; ``unpacked_tensors`` those brought back in backward. A unit's
    forward run under another checkpoint, in backward, or with autograd off pushes no
    hooks and counts nothing.
    """

    def __init__(self) -> None:
        self.packed_tensors = 0
        self.packed_bytes = 0
        self.unpacked_tensors = 0
        # (module, hooks or None) per unit call in progress, innermost last.
        self._calls: list[tuple[nn.Module, saved_tensors_hooks | None]] = []

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _HostCopy:
        if not _offloadable(tensor):
            return tensor
        on_cuda = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=on_cuda)
        # Non-blocking from CUDA is safe: the copy back is queued on the same stream.
        host.copy_(tensor.detach(), non_blocking=on_cuda)
        self.packed_tensors += 1
        self.packed_bytes += host.nbytes
        return _HostCopy(host, tensor.device)

    def unpack(self, packed: torch.Tensor | _HostCopy) -> torch.Tensor:
        if not isinstance(packed, _HostCopy):
            return packed
        self.unpacked_tensors += 1
        return packed.tensor.to(packed.device, non_blocking=True)

    def reset_counters(self) -> None:
        self.packed_tensors = self.packed_bytes = self.unpacked_tensors = 0

    def _enter(self, module: nn.Module, _args: Any) -> None:
        hooks = None
        if torch.is_grad_enabled() and not under_outer_checkpoint():
            hooks = saved_tensors_hooks(self.pack, self.unpack)
            hooks.__enter__()
        self._calls.append((module, hooks))

    def _exit(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # Always called, also when the forward raised; but if an earlier pre-hook raised,
        # `_enter` never ran for this call and there is nothing of ours to pop.
        if not self._calls or self._calls[-1][0] is not module:
            return
        _, hooks = self._calls.pop()
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
