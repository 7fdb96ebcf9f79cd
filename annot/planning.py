"""`annot.plan`: the Plan for a model, from a policy or from its marks / HF metadata."""

from __future__ import annotations

import dataclasses

from torch import nn

from annot.module_state import peek_state
from annot.policies import Plan, Policy, Rule, make_plan
from annot.policies.parallel import ParallelDims
from annot.policies.speed import with_speed_actions

__all__ = ["plan", "resolve_plan"]


def plan(model: nn.Module, policy: Policy | Rule | None = None, *,
         parallel: ParallelDims | None = None, float8: str | bool | None = None,
         compile: bool | None = None) -> Plan:
    """Plan ``model`` without allocating (build it under ``torch.device("meta")``).

    ``policy=None`` uses the model's marks (`shard_block`, `mark`, ...) and otherwise its
    HuggingFace ``_no_split_modules``; a bare rule means "shard what it selects". Raises
    `annot.PlanError` when the plan would be wrong or would do nothing. ``parallel``: the
    parallel dimensions (`annot.ParallelDims`, e.g. ``replicate=2`` for HSDP); the table
    shows them and ``auto_wrap`` builds its mesh from them. ``float8`` (a recipe) and
    ``compile`` (``True``) give the Plan the speed actions as ``auto_wrap(float8=...,
    compile=...)`` does (`annot.policies.speed.with_speed_actions`), so the printed
    Plan is the one applied.
    """
    made = _with_notes(model, make_plan(model, policy))
    if float8 is not None or compile is not None:
        made = with_speed_actions(made, model, float8=float8, compile=compile)
    if parallel is not None and not isinstance(parallel, ParallelDims):
        raise TypeError(f"parallel= takes annot.ParallelDims, not {type(parallel).__name__}")
    return dataclasses.replace(made, parallel=parallel) if parallel is not None else made


def resolve_plan(model: nn.Module, policy: Policy | Rule | Plan | None) -> Plan:
    """The Plan for ``model``: ``policy`` itself if it is one (checked against the model),
    else planned from it."""
    if not isinstance(policy, Plan):
        return _with_notes(model, make_plan(model, policy))
    for unit in policy.units:
        for path in unit.modules:
            try:
                model.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"the Plan names module {path!r}, which {type(model).__name__} does not "
                    "have: was the Plan made for another model?"
                ) from None
    return policy


def _with_notes(model: nn.Module, made: Plan) -> Plan:
    """``made`` with the notes the code that built ``model`` left for its Plan
    (`annot.module_state.ModuleState.plan_notes`) among its warnings."""
    state = peek_state(model)
    notes = [note for note in (state.plan_notes if state else ()) if note not in made.warnings]
    return dataclasses.replace(made, warnings=(*made.warnings, *notes)) if notes else made
