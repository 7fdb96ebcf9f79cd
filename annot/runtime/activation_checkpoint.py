"""Run-time activation checkpointing that leaves the module tree and names alone.

`checkpoint_module` replaces one module's ``forward`` (on the instance, not the class)
with a call through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Nothing is
wrapped, so ``named_parameters()`` and ``state_dict()`` keys stay those of the bare model
(no ``_checkpoint_wrapped_module``: docs/design.md, pitfall 5), and engines that hook
``__call__`` (FSDP2's all-gather, DDP) see the same module as before. Recomputation in
backward calls the original ``forward`` directly, inside the engine's unit, after the
engine has gathered the unit's parameters for backward.

Checkpointing is skipped in eval mode and when autograd is off (``torch.no_grad()``,
``torch.inference_mode()``): nothing is saved for backward then, so there is nothing to
recompute.

It is also skipped, per call, where the forward already runs under another activation
checkpoint (a model rewritten by ``annot rewrite``, a hand-written
``torch.utils.checkpoint`` or ``deepspeed.checkpointing.checkpoint`` call around the
block, HuggingFace's ``gradient_checkpointing_enable``): a second checkpoint would only
add a recomputation. The first such call warns once per class and marks the module
(`has_outer_checkpoint`). How it is detected, and the limits, are in
`annot.runtime.autograd_state`.

Under ``torch.compile`` (``block.compile(fullgraph=True)`` per block, or a whole bare
model) the forward is traced without graph breaks: the detection reads autograd state
dynamo cannot trace, so while compiling annot skips it and always checkpoints a training
forward; dynamo turns torch's checkpoint into a ``tag_activation_checkpoint`` region that
the compiled backward recomputes. Eval mode and ``no_grad`` still run the plain forward
(dynamo guards on both and compiles one graph for each). The cost under an outer
checkpoint is in `annot.runtime.autograd_state`. DeepSpeed's checkpoint function is traced
as whatever it is; only torch's is measured under compile.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from annot.module_state import module_state, peek_state
from annot.policies import Action, Plan
from annot.runtime.autograd_state import under_outer_checkpoint
from annot.runtime.units import unit_paths

__all__ = [
    "apply_checkpointing",
    "checkpoint_module",
    "checkpointed_paths",
    "has_outer_checkpoint",
    "is_checkpointed",
    "torch_checkpoint",
]

CheckpointFn = Callable[..., Any]  # (function, *args, **kwargs) -> function's output


def torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint (docs/design.md, pitfall 5): works with kwargs, with
    inputs that do not require grad, and with engines' backward hooks; it stops
    recomputing early once every needed tensor is rebuilt."""
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = module_state(self)
    original = state.original_forward
    assert original is not None and state.checkpoint_fn is not None
    if not (self.training and torch.is_grad_enabled()):
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Traced by dynamo (constant-folded): the outer-checkpoint test reads autograd
        # state dynamo cannot trace (4 graph breaks, no fullgraph=True), so checkpoint
        # unconditionally. Under an outer checkpoint: `annot.runtime.autograd_state`.
        return state.checkpoint_fn(original, *args, **kwargs)
    if under_outer_checkpoint():
        _note_outer_checkpoint(self)
        return original(*args, **kwargs)
    return state.checkpoint_fn(original, *args, **kwargs)


def _note_outer_checkpoint(module: nn.Module) -> None:
    state = module_state(module)
    if state.outer_checkpoint:
        return
    state.outer_checkpoint = True
    # Same text for every instance of a class, so Python's warning filter shows it once.
    warnings.warn(
        f"annot: {type(module).__name__}'s forward already runs under an activation "
        "checkpoint in the model's own code (e.g. one `annot rewrite` inserted); annot does "
        "not checkpoint it a second time. Pass checkpoint=False to auto_wrap to say so.",
        stacklevel=3,
    )


def is_checkpointed(module: nn.Module) -> bool:
    """True if annot checkpoints ``module`` at run time (`checkpoint_module` ran on it)."""
    state = peek_state(module)
    return state is not None and state.original_forward is not None


def has_outer_checkpoint(module: nn.Module) -> bool:
    """True once a training forward of ``module`` found it already under another
    checkpoint, so annot ran it without its own (see the module docstring)."""
    state = peek_state(module)
    return state is not None and state.outer_checkpoint


def checkpoint_module(module: nn.Module, checkpoint_fn: CheckpointFn = torch_checkpoint) -> nn.Module:
    """Checkpoint ``module``'s activations at run time (in place; returns ``module``).

    ``checkpoint_fn(forward, *args, **kwargs)`` runs the forward under checkpointing:
    torch's non-reentrant one by default, DeepSpeed's for the DeepSpeed engine.
    Applying it twice is an error rather than a silent second layer of recomputation.
    """
    if is_checkpointed(module):
        raise ValueError(f"{type(module).__name__} is already checkpointed by annot")
    state = module_state(module)
    state.checkpoint_fn = checkpoint_fn
    # The bound forward as it is now (the class's, or one another tool set on the instance).
    state.original_forward = module.forward
    # A bound method (not a closure) so copy.deepcopy rebinds it to the copy.
    module.forward = types.MethodType(_checkpointed_forward, module)
    return module


def checkpointed_paths(plan: Plan, checkpoint: bool | None) -> list[str]:
    """Module paths to checkpoint: the Plan's (``None``), every unit (``True``) or none."""
    return unit_paths(plan, Action.CHECKPOINT, checkpoint)


def apply_checkpointing(
    model: nn.Module, paths: Iterable[str], checkpoint_fn: CheckpointFn = torch_checkpoint
) -> list[str]:
    """Checkpoint the modules of ``model`` at ``paths``; returns the paths, in order."""
    done = []
    for path in paths:
        checkpoint_module(model.get_submodule(path), checkpoint_fn)
        done.append(path)
    return done
