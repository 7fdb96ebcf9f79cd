"""Which modules of a Plan get a run-time action (checkpointing, activation offload)."""

from __future__ import annotations

from annot.policies import Action, Plan

__all__ = ["unit_paths"]


def unit_paths(plan: Plan, action: Action, choice: bool | None) -> list[str]:
    """Module paths of the units with ``action`` (``choice=None``: as the Plan says),
    of every unit sharded, checkpointed or offloaded (``True``: not one that only computes
    in float8 or compiles, an output head of its own, say), or none (``False``); a tied
    group's modules included."""
    if choice is False:
        return []
    placed = (Action.SHARD, Action.CHECKPOINT, Action.OFFLOAD)
    units = ([u for u in plan.units if any(u.has(a) for a in placed)] if choice
             else [u for u in plan.units if u.has(action)])
    return [path for unit in units for path in unit.modules]
