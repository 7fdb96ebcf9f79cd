"""`annot.apply_checkpointing`: the Plan's activation checkpointing on a model another tool
will wrap (Lightning's ``DeepSpeedStrategy`` or ``FSDPStrategy``, the HuggingFace Trainer,
Accelerate), where annot's engine does not run.

The checkpointing is annot's run-time one (`annot.runtime.activation_checkpoint`): the
module's ``forward`` is swapped on the instance, so names and state-dict keys stay the
bare model's and the tool's wrapping, done later, still sees the Plan's modules (the
engines' hooks run around the swapped forward, inside each unit).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from annot.engines.base import Engine
from annot.engines.registry import get_engine
from annot.huggingface.model import prepare_for_training
from annot.planning import resolve_plan
from annot.policies import Plan, Policy, Rule
from annot.runtime.activation_checkpoint import apply_checkpointing as _apply

__all__ = ["apply_checkpointing"]


def apply_checkpointing(
    model: nn.Module,
    policy: Policy | Rule | Plan | None = None,
    *,
    engine: str = "torch",
    checkpoint: bool | None = None,
) -> list[str]:
    """Checkpoint the modules the Plan of ``model`` checkpoints; returns their paths.

    ``policy`` is what `annot.auto_wrap` takes; ``checkpoint`` ``None`` the Plan's
    choice, ``True`` every unit. ``engine="torch"``: torch's non-reentrant checkpoint
    (for FSDP1/FSDP2/DDP wrappers). ``engine="deepspeed"``: DeepSpeed's checkpoint, so
    the config's ``partition_activations``/``cpu_checkpointing`` apply once
    ``deepspeed.checkpointing.configure`` has run with it (Lightning's
    ``DeepSpeedStrategy`` runs it from the config's ``activation_checkpointing``
    section); modules sharing a parameter with the rest of the model (tied weights) are
    left out there, logged (DeepSpeed's checkpoint is reentrant). A transformers model
    inside ``model`` then trains with ``use_cache=False`` and its own gradient
    checkpointing off (docs/design.md, pitfall 14). A Plan that checkpoints nothing
    (with ``checkpoint`` not ``False``) is an error: nothing would be checkpointed,
    silently (pitfall 8).
    """
    if engine not in ("torch", "deepspeed"):
        raise ValueError(f"engine must be 'torch' or 'deepspeed', got {engine!r}")
    # The engine says what it checkpoints and with which function (the engine contract);
    # "torch" is the contract's defaults, which every torch engine keeps.
    steps: Engine[Any] = Engine() if engine == "torch" else get_engine(engine)
    plan = resolve_plan(model, policy)
    paths = steps.checkpoint_paths(model, plan, checkpoint)
    if not paths and checkpoint is not False:
        raise ValueError(
            f"the Plan of {type(model).__name__} checkpoints no module"
            + (" that DeepSpeed can (tied weights)" if engine == "deepspeed" else "")
            + ": pass checkpoint=True (every unit) or a policy with checkpoint=...")
    prepare_for_training(model, checkpointing=bool(paths))
    return _apply(model, paths, steps.checkpoint_function())
