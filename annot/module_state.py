"""The one place annot keeps run-time state on a user's module.

Everything annot attaches to a module instance at run time (the construction record of
`annot.meta_init`, what a replay counted, the forward that run-time checkpointing
replaced, the activation offloader) lives in one `ModuleState` under one instance
attribute, ``module.__dict__["_annot_state"]``: not a parameter, buffer or submodule, so
``state_dict()``, ``named_parameters()`` and the module tree are as they were. It is
copied along with the module by ``copy.deepcopy`` (a bound forward is rebound to the
copy). Declarations made with `annot.mark` / ``@shard_block`` are a different thing:
they live on classes as well as instances and belong to `annot.policies`
(`annot.policies.marks`), which never imports the rest of annot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ModuleState", "module_state", "peek_state"]

_ATTR = "_annot_state"


@dataclasses.dataclass
class ModuleState:
    """annot's run-time state of one module instance (every field optional)."""

    #: `annot.meta.deferred.DeferredInit`: how `annot.meta_init` built this root module.
    construction: Any = None
    #: `annot.meta.materialization.ReplayStats` of the last `materialize` of this root.
    replay_stats: Any = None
    #: Peak bytes of full tensors alive at once while an engine allocated it unit by unit.
    unit_allocation_peak: int | None = None
    #: The forward run-time checkpointing replaced (set: the module is checkpointed).
    original_forward: Callable[..., Any] | None = None
    #: ``fn(forward, *args, **kwargs)`` running that forward under checkpointing.
    checkpoint_fn: Callable[..., Any] | None = None
    #: True once a forward found the module already under someone else's checkpoint.
    outer_checkpoint: bool = False
    #: `annot.runtime.activation_offload.ActivationOffloader` whose hooks it carries.
    activation_offloader: Any = None
    #: The hook passing ``use_cache=False`` to a transformers model's training forwards.
    no_cache_hook: Any = None
    #: `annot.huggingface.modality_standin.ModalityStandIns` hooked onto a transformers
    #: model with a tower (``False``: looked for, none needed).
    stand_ins: Any = None
    #: What the code that built this root decided and its Plan must say (added to the
    #: Plan's warnings by `annot.plan` and `annot.auto_wrap`), e.g. the parameters
    #: `annot.from_pretrained` trains though their constructor froze them.
    plan_notes: tuple[str, ...] = ()


def peek_state(module: nn.Module) -> ModuleState | None:
    """``module``'s state, or ``None`` if annot never attached any."""
    state = module.__dict__.get(_ATTR)
    return state if isinstance(state, ModuleState) else None


def module_state(module: nn.Module) -> ModuleState:
    """``module``'s state, created empty on first use."""
    state = peek_state(module)
    if state is None:
        state = module.__dict__[_ATTR] = ModuleState()
    return state
