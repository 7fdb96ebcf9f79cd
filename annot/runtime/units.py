"""Which modules of a Plan get a run-time action (checkpointing, activation offload)."""

from __future__ import annotations

from annot.policies import Action, Plan

__all__ = ["unit_paths"]


def unit_paths(plan: Plan, action: Action, choice: bool | None) -> list[str]:
    """Module paths of the units with ``action`` (``choice=None``: as the Plan says),
    of every unit (``True``), or none (``False``); a tied group's modules included."""
    if choice is False:
        return []
    units = plan.units if choice else [u for u in plan.units if u.has(action)]
    return [path for unit in units for path in unit.modules]
