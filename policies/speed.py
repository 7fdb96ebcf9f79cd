"""The Plan's speed actions: which linears compute in float8, which units compile.

A unit with `Action.FLOAT8` has its eligible linears compute their matmuls in float8
(`annot.float8` applies it); a unit with `Action.COMPILE` has its forward compiled
(`annot.compiled_blocks`). A linear belongs to the deepest unit holding it (a unit of
its own, or the block around it); only the linears of float8 units are converted, and
of those only the eligible ones (`ineligible_because`): a plain ``nn.Linear`` with a
floating weight, both dimensions multiples of 16 (the float8 matmul's requirement), not
a mixture-of-experts router.

When ``auto_wrap(float8=..., compile=...)`` is asked for a Plan that has no such unit,
`with_speed_actions` gives the actions to the repeated blocks (the shard units whose
class occurs more than once): the transformer layers, leaving the embeddings, the output
head and whatever runs once to the model's dtype and to eager mode, as torchtitan does.
Pure ``torch.nn``: this module is part of ``annot.policies``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from torch import nn

from annot.policies.errors import PlanError
from annot.policies.experts import router_paths
from annot.policies.marks import Action
from annot.policies.model_index import is_under
from annot.policies.plan import FLOAT8_RECIPES, Plan, Unit

__all__ = ["FLOAT8_MULTIPLE", "Float8Linears", "float8_linears", "ineligible_because", "refusal_of_recipe",
           "repeated_units", "with_float8_counts", "with_speed_actions"]

#: Both dimensions of a float8 linear's weight must be multiples of this (``_scaled_mm``).
FLOAT8_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Float8Linears:
    """The linears of a model's float8 units: those converted, per unit path, and those
    left in the model's dtype, each with the reason."""

    chosen: dict[str, tuple[str, ...]]
    kept: dict[str, str]

    @property
    def paths(self) -> tuple[str, ...]:
        """Every converted linear's module path."""
        return tuple(path for paths in self.chosen.values() for path in paths)

    def describe(self) -> str:
        """One paragraph: how many linears compute in float8, and each kept one's reason."""
        lines = [f"float8: {len(self.paths)} linears in {len(self.chosen)} units"]
        if self.kept:
            lines.append("kept in the model's dtype: " + "; ".join(
                f"{path} ({reason})" for path, reason in self.kept.items()))
        return "\n".join(lines)


def ineligible_because(module: nn.Module, path: str, routers: set[str]) -> str | None:
    """Why the linear ``module`` at ``path`` cannot compute in float8, or ``None``."""
    if type(module).__name__ == "Float8Linear":
        return "already a float8 linear"
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__}, not a plain nn.Linear (its forward is its own)"
    if path in routers:
        return "a mixture-of-experts router"
    if not module.weight.dtype.is_floating_point:
        return f"stored as {module.weight.dtype}"
    if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
        return (f"{module.out_features} x {module.in_features}: float8 matmuls need both "
                f"dimensions multiples of {FLOAT8_MULTIPLE}")
    return None


def float8_linears(model: nn.Module, units: tuple[Unit, ...] | list[Unit]) -> Float8Linears:
    """Which linears of ``model`` the float8 ``units`` convert (see the module docstring)."""
    by_path = {path: unit for unit in units for path in unit.modules}
    routers = router_paths(model)
    chosen: dict[str, list[str]] = {}
    kept: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        owner = _deepest_unit(by_path, path)
        if owner is None or not owner.has(Action.FLOAT8):
            continue
        reason = ineligible_because(module, path, routers)
        if reason is None:
            chosen.setdefault(owner.path, []).append(path)
        else:
            kept[path] = reason
    return Float8Linears({unit: tuple(paths) for unit, paths in chosen.items()}, kept)


def _deepest_unit(by_path: dict[str, Unit], path: str) -> Unit | None:
    holders = [p for p in by_path if is_under(path, p)]
    return by_path[max(holders, key=len)] if holders else None


def with_float8_counts(model: nn.Module, units: list[Unit]) -> list[Unit]:
    """``units`` with each float8 unit's count of converted linears."""
    if not any(u.has(Action.FLOAT8) for u in units):
        return units
    chosen = float8_linears(model, units).chosen
    return [dataclasses.replace(u, float8_linears=len(chosen.get(u.path, ()))) if u.has(Action.FLOAT8) else u
            for u in units]


def repeated_units(plan: Plan) -> list[Unit]:
    """The Plan's repeated blocks: its shard units whose class occurs more than once."""
    classes = Counter(u.cls for u in plan.units if u.has(Action.SHARD))
    return [u for u in plan.units if u.has(Action.SHARD) and classes[u.cls] > 1 and u.path]


def with_speed_actions(plan: Plan, model: nn.Module, *, float8: str | bool | None = None,
                       compile: bool | None = None) -> Plan:
    """``plan`` with the float8 and compile actions ``auto_wrap`` was asked for.

    ``float8``: ``None`` keeps the Plan's float8 units; ``False`` drops them; a recipe
    (`FLOAT8_RECIPES`) sets it on the Plan's float8 units, or, where it has none, makes
    the repeated blocks (`repeated_units`) float8 units. ``compile``: ``None`` keeps the
    Plan's, ``False`` drops them, ``True`` keeps them or compiles the repeated blocks.
    Raises `PlanError` when the Plan has no repeated block to choose."""
    if isinstance(float8, str) and float8 not in FLOAT8_RECIPES:
        raise ValueError(refusal_of_recipe(float8))
    units = list(plan.units)
    if float8 is False:
        units = [_without(u, Action.FLOAT8) for u in units]
    elif isinstance(float8, str):
        units = _with_action(plan, units, Action.FLOAT8, f"float8={float8}")
        units = [dataclasses.replace(u, float8_recipe=float8) if u.has(Action.FLOAT8) else u for u in units]
    if compile is False:
        units = [_without(u, Action.COMPILE) for u in units]
    elif compile:
        units = _with_action(plan, units, Action.COMPILE, "compile=True")
    units = with_float8_counts(model, [u for u in units if u.actions])
    return dataclasses.replace(plan, units=tuple(units))


def refusal_of_recipe(recipe: str) -> str:
    """Why annot does not apply the float8 recipe ``recipe``, and what it takes."""
    choose = f"choose a recipe from {', '.join(FLOAT8_RECIPES)}"
    if recipe.lower().startswith("mx"):
        return (f"float8 recipe {recipe!r}: the MX formats (a scale per block of 32 elements) "
                "need the matmul of an SM100 (Blackwell) GPU, which torch._scaled_mm has nowhere "
                f"else, and annot does not apply them; {choose}")
    return f"float8 recipe {recipe!r}: {choose}"


def _with_action(plan: Plan, units: list[Unit], action: Action, asked: str) -> list[Unit]:
    if any(u.has(action) for u in units):
        return units
    blocks = {u.path for u in repeated_units(plan)}
    if action is Action.COMPILE:
        # The outermost blocks only: a block's compiled forward traces what it calls (an
        # attention unit inside mBART's decoder layer is compiled with its layer).
        blocks = {b for b in blocks if not any(b != o and is_under(b, o) for o in blocks)}
    if not blocks:
        raise PlanError(
            f"{asked}: the Plan for {plan.model} has no {action.value} unit and no repeated "
            f"blocks to give it to (no shard unit's class occurs twice): say which modules in "
            f"the policy, e.g. Policy(shard=..., {action.value}=by_class(Block))")
    return [dataclasses.replace(u, actions=tuple(a for a in Action if a in {*u.actions, action}),
                                reason=f"{u.reason}; {action.value}: {asked} (repeated block)")
            if u.path in blocks else u for u in units]


def _without(unit: Unit, action: Action) -> Unit:
    if not unit.has(action):
        return unit
    return dataclasses.replace(unit, actions=tuple(a for a in unit.actions if a is not action),
                               float8_recipe=None if action is Action.FLOAT8 else unit.float8_recipe,
                               float8_linears=None if action is Action.FLOAT8 else unit.float8_linears)
