"""The Plan: which modules become units, with which actions and why.

A Plan is plain data. It is built on the meta device without allocating (see
`policies.make_plan`), prints as a table, round-trips through JSON, and is what the
engines apply and what tests assert on.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from annot.policies.errors import PlanError
from annot.policies.experts import MoeBlock, describe_moe
from annot.policies.marks import Action
from annot.policies.parallel import ParallelDims
from annot.policies.rules import format_count

__all__ = ["CHECKPOINT_POLICIES", "FLOAT8_RECIPES", "Plan", "RootInfo", "Unit", "format_bytes"]

FORMAT_VERSION = 1
#: Selective checkpoint policies a unit may name (`Unit.checkpoint_policy`); the run time
#: that applies them is `annot.runtime.selective_checkpoint`.
CHECKPOINT_POLICIES: tuple[str, ...] = ("save_matmuls",)
#: The float8 training recipes a unit may name (`Unit.float8_recipe`; torchao's names):
#: one scale per tensor, one per row, one per row with the weight gradient's matmul kept
#: in high precision. `annot.float8` applies them.
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of the Plan.

    ``path`` is the module's path (``""`` is the whole model); ``group`` lists further
    modules sharded together with it (tied weights). ``params`` and ``bytes`` count the
    parameters this unit holds itself, excluding nested shard units.
    """

    path: str
    cls: str
    params: int
    bytes: dict[str, int]
    actions: tuple[Action, ...]
    reason: str
    group: tuple[str, ...] = ()
    offload_to: str | None = None
    #: How many of ``params`` require grad (``None``: not counted, e.g. an old JSON plan).
    trainable: int | None = None
    #: A checkpointed unit's selective policy (`CHECKPOINT_POLICIES`: ``"save_matmuls"``
    #: keeps matmul outputs and recomputes the rest); ``None``: full checkpoint.
    checkpoint_policy: str | None = None
    #: Whether what autograd saves inside this unit waits on the host (activation
    #: offload, on the torch engines that offload activations; not parameter offload).
    offload_activations: bool = False
    #: The part of the model the unit belongs to (`annot.policies.roles`: ``"vision"``,
    #: ``"projector"``, ``"language"``, ``"encoder"``, ...), ``None`` in a model of one part.
    role: str | None = None
    #: How many of ``params`` a quantized base holds quantized (QLoRA's NF4 linears);
    #: ``None``: no quantization was asked.
    quantized: int | None = None
    #: A float8 unit's recipe (`FLOAT8_RECIPES`); ``None`` when the unit has no float8.
    float8_recipe: str | None = None
    #: How many linears of a float8 unit compute in float8 (`annot.policies.speed`).
    float8_linears: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_policy is not None and self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise PlanError(f"unit {self.path!r}: unknown checkpoint policy {self.checkpoint_policy!r}; "
                            f"choose from {', '.join(CHECKPOINT_POLICIES)}")
        if self.float8_recipe is not None and self.float8_recipe not in FLOAT8_RECIPES:
            raise PlanError(f"unit {self.path!r}: unknown float8 recipe {self.float8_recipe!r}; "
                            f"choose from {', '.join(FLOAT8_RECIPES)}")

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module path of this unit, ``path`` first."""
        return (self.path, *self.group)

    def has(self, action: Action | str) -> bool:
        return Action(action) in self.actions

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "cls": self.cls,
            "params": self.params,
            "bytes": dict(self.bytes),
            "actions": [a.value for a in self.actions],
            "reason": self.reason,
        }
        if self.group:
            out["group"] = list(self.group)
        if self.offload_to:
            out["offload_to"] = self.offload_to
        if self.trainable is not None:
            out["trainable"] = self.trainable
        if self.checkpoint_policy is not None:
            out["checkpoint_policy"] = self.checkpoint_policy
        if self.offload_activations:
            out["offload_activations"] = True
        if self.role is not None:
            out["role"] = self.role
        if self.quantized is not None:
            out["quantized"] = self.quantized
        if self.float8_recipe is not None:
            out["float8_recipe"] = self.float8_recipe
        if self.float8_linears is not None:
            out["float8_linears"] = self.float8_linears
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Unit:
        return cls(
            path=data["path"],
            cls=data["cls"],
            params=int(data["params"]),
            bytes={str(k): int(v) for k, v in data.get("bytes", {}).items()},
            actions=tuple(Action(a) for a in data["actions"]),
            reason=data["reason"],
            group=tuple(data.get("group", ())),
            offload_to=data.get("offload_to"),
            trainable=None if data.get("trainable") is None else int(data["trainable"]),
            checkpoint_policy=data.get("checkpoint_policy"),
            offload_activations=bool(data.get("offload_activations", False)),
            role=data.get("role"),
            quantized=None if data.get("quantized") is None else int(data["quantized"]),
            float8_recipe=data.get("float8_recipe"),
            float8_linears=None if data.get("float8_linears") is None else int(data["float8_linears"]),
        )


@dataclasses.dataclass(frozen=True)
class RootInfo:
    """What no shard unit holds: it stays with the root, which engines wrap last."""

    params: int
    bytes: dict[str, int]
    modules: tuple[str, ...]  # modules holding parameters directly in the root group
    trainable: int | None = None  # how many of ``params`` require grad
    quantized: int | None = None  # how many of ``params`` are quantized (None: not asked)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "params": self.params, "bytes": dict(self.bytes), "modules": list(self.modules)}
        if self.trainable is not None:
            out["trainable"] = self.trainable
        if self.quantized is not None:
            out["quantized"] = self.quantized
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RootInfo:
        return cls(
            params=int(data["params"]),
            bytes={str(k): int(v) for k, v in data.get("bytes", {}).items()},
            modules=tuple(data.get("modules", ())),
            trainable=None if data.get("trainable") is None else int(data["trainable"]),
            quantized=None if data.get("quantized") is None else int(data["quantized"]),
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Units in application order (children before parents), the root's leftovers, the
    tied-parameter groups (each a tuple of parameter names) and non-fatal warnings."""

    model: str
    policy: str
    units: tuple[Unit, ...]
    root: RootInfo
    tied: tuple[tuple[str, ...], ...]
    total_params: int
    total_bytes: dict[str, int]
    warnings: tuple[str, ...] = ()
    #: The parallel dimensions asked for (`annot.plan(..., parallel=...)`), if any; the
    #: engines build their device mesh from it when ``auto_wrap`` gets no ``mesh=``.
    parallel: ParallelDims | None = None
    #: The model's mixture-of-experts blocks (`annot.policies.experts`), module order.
    moe: tuple[MoeBlock, ...] = ()
    #: The role of what the root holds (a diffusers model's: ``"denoiser"``), if any.
    root_role: str | None = None

    def unit(self, path: str) -> Unit:
        for unit in self.units:
            if path in unit.modules:
                return unit
        raise KeyError(f"no unit for module {path!r} in this plan")

    def paths(self, action: Action | str | None = None) -> list[str]:
        """Unit paths, all or those with ``action``."""
        return [u.path for u in self.units if action is None or u.has(action)]

    # JSON ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "policy": self.policy,
            "units": [u.to_dict() for u in self.units],
            "root": self.root.to_dict(),
            "tied": [list(group) for group in self.tied],
            "total_params": self.total_params,
            "total_bytes": dict(self.total_bytes),
            "warnings": list(self.warnings),
            **({"parallel": self.parallel.to_dict()} if self.parallel is not None else {}),
            **({"moe": [block.to_dict() for block in self.moe]} if self.moe else {}),
            **({"root_role": self.root_role} if self.root_role is not None else {}),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise PlanError(f"plan format version {version} is not supported (expected {FORMAT_VERSION})")
        try:
            return cls(
                model=data["model"],
                policy=data.get("policy", ""),
                units=tuple(Unit.from_dict(u) for u in data["units"]),
                root=RootInfo.from_dict(data["root"]),
                tied=tuple(tuple(group) for group in data.get("tied", ())),
                total_params=int(data["total_params"]),
                total_bytes={str(k): int(v) for k, v in data.get("total_bytes", {}).items()},
                warnings=tuple(data.get("warnings", ())),
                parallel=ParallelDims.from_dict(data["parallel"]) if "parallel" in data else None,
                moe=tuple(MoeBlock.from_dict(block) for block in data.get("moe", ())),
                root_role=data.get("root_role"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"not a valid plan: {type(exc).__name__}: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"not a valid plan: bad JSON: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError("not a valid plan: expected a JSON object")
        return cls.from_dict(data)

    # Table -----------------------------------------------------------------

    def table(self, *, collapse: bool = True) -> str:
        """A readable table. With ``collapse``, runs of identical sibling units
        (``model.layers.0`` ... ``model.layers.79``) print as one row."""
        header: tuple[str, ...] = ("#", "unit", "class", "params", "size", "actions", "reason")
        rows: list[tuple[str, ...]] = [
            (
                str(first) if first == last else f"{first}-{last}",
                label,
                u.cls.rpartition(".")[2],
                format_count(u.params) + (f" x{last - first + 1}" if first != last else ""),
                format_bytes(sum(u.bytes.values())),
                _actions_cell(u),
                u.reason,
            )
            for first, last, label, u in _rows(self.units, collapse)
        ]
        rows.append(
            ("", "(root)", self.model, format_count(self.root.params),
             format_bytes(sum(self.root.bytes.values())), "shard (last)", "what no unit holds")
        )
        if self.has_frozen:  # fine-tuning: say what each unit trains
            trainable = [u.trainable for _, _, _, u in _rows(self.units, collapse)] + [self.root.trainable]
            header = (*header[:4], "trainable", *header[4:])
            rows = [(*r[:4], _trainable_cell(n), *r[4:]) for r, n in zip(rows, trainable, strict=True)]
        if self.root.quantized is not None:  # a quantized base: how much of each unit is
            quantized = [u.quantized for _, _, _, u in _rows(self.units, collapse)] + [self.root.quantized]
            at = header.index("size")
            header = (*header[:at], "quantized", *header[at:])
            rows = [(*r[:at], _quantized_cell(n), *r[at:]) for r, n in zip(rows, quantized, strict=True)]
        if any(u.role is not None for u in self.units):  # a model of several parts: say which
            unit_roles = [u.role or "" for _, _, _, u in _rows(self.units, collapse)] + [self.root_role or ""]
            header = (*header[:2], "role", *header[2:])
            rows = [(*r[:2], role, *r[2:]) for r, role in zip(rows, unit_roles, strict=True)]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"Plan for {self.model}  (policy: {self.policy})"]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        # The speed actions are counted only where some unit has them.
        counts = {a: len(self.paths(a)) for a in Action
                  if a in (Action.SHARD, Action.CHECKPOINT, Action.OFFLOAD) or self.paths(a)}
        lines.append(
            f"total: {format_count(self.total_params)} params, "
            f"{format_bytes(sum(self.total_bytes.values()))} "
            f"({', '.join(f'{k} {format_bytes(v)}' for k, v in self.total_bytes.items())}); "
            f"{len(self.units)} units: "
            + ", ".join(f"{n} {a.value}" for a, n in counts.items())
        )
        for u in self.units:
            if u.group:
                lines.append(f"group: {' + '.join(u.modules)} (one shard unit)")
        for group in self.tied:
            lines.append(f"tied: {' = '.join(group)}")
        lines += describe_moe(self.moe)
        if self.parallel is not None:
            lines.append(f"parallel: {self.parallel.describe()}: {self.parallel.meaning()}")
        for warning in self.warnings:
            lines.append(f"warning: {warning}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    @property
    def has_frozen(self) -> bool:
        """Whether some parameter of the model does not require grad (fine-tuning)."""
        counts: list[tuple[int | None, int]] = [(u.trainable, u.params) for u in self.units]
        counts.append((self.root.trainable, self.root.params))
        return any(trainable is not None and trainable < params for trainable, params in counts)

    def mixed_dtype_units(self) -> list[str]:
        """Shard units (and the root, as ``"(root)"``) holding parameters of several dtypes."""
        mixed = [u.path for u in self.units if u.has(Action.SHARD) and len(u.bytes) > 1]
        return mixed + (["(root)"] if len(self.root.bytes) > 1 else [])


def _actions_cell(unit: Unit) -> str:
    """The unit's actions, comma-separated, the offload target, the selective checkpoint
    policy and the float8 recipe (with its count of linears) after them."""
    speed = [a for a in unit.actions if a in (Action.FLOAT8, Action.COMPILE)]
    cell = (",".join(a.value for a in unit.actions if a not in speed)
            + (f"->{unit.offload_to}" if unit.offload_to else "")
            + (f"({unit.checkpoint_policy})" if unit.checkpoint_policy else "")
            + (",offload_activations" if unit.offload_activations else ""))
    for action in speed:
        label = action.value
        if action is Action.FLOAT8:
            label += f"({unit.float8_recipe}" + (f" x{unit.float8_linears}" if unit.float8_linears is not None
                                                 else "") + ")"
        cell = f"{cell},{label}" if cell else label
    return cell


def _quantized_cell(quantized: int | None) -> str:
    return "-" if not quantized else format_count(quantized)


def _trainable_cell(trainable: int | None) -> str:
    return "?" if trainable is None else ("frozen" if trainable == 0 else format_count(trainable))


def _path_label(unit: Unit) -> str:
    return (unit.path or "(whole model)") + (f" +{len(unit.group)}" if unit.group else "")


def _indexed(path: str) -> tuple[str, int] | None:
    """``"model.layers.7"`` -> ``("model.layers", 7)``; None when the last name is not a number."""
    head, _, tail = path.rpartition(".")
    return (head, int(tail)) if tail.isdigit() else None


def _same_but_path(a: Unit, b: Unit) -> bool:
    return not a.group and not b.group and (
        (a.cls, a.params, a.trainable, a.bytes, a.actions, a.offload_to, a.reason,
         a.checkpoint_policy, a.offload_activations, a.role, a.quantized, a.float8_recipe,
         a.float8_linears)
        == (b.cls, b.params, b.trainable, b.bytes, b.actions, b.offload_to, b.reason,
            b.checkpoint_policy, b.offload_activations, b.role, b.quantized, b.float8_recipe,
            b.float8_linears)
    )


def _run_end(units: tuple[Unit, ...], i: int) -> int:
    """Last index of the run of siblings ``prefix.N``, ``prefix.N+1``, ... starting at ``i``
    that agree on everything but the path."""
    start = _indexed(units[i].path)
    j = i
    while (
        start is not None
        and j + 1 < len(units)
        and _indexed(units[j + 1].path) == (start[0], start[1] + j + 1 - i)
        and _same_but_path(units[i], units[j + 1])
    ):
        j += 1
    return j


def _rows(units: tuple[Unit, ...], collapse: bool):
    """(first index, last index, label, unit) per table row; runs of three or more
    identical siblings share a row when ``collapse``."""
    i = 0
    while i < len(units):
        j = _run_end(units, i) if collapse else i
        if j >= i + 2:
            prefix, first = _indexed(units[i].path)  # type: ignore[misc]
            yield i, j, f"{prefix}.[{first}-{first + j - i}]", units[i]
            i = j + 1
        else:
            yield i, i, _path_label(units[i]), units[i]
            i += 1


def format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
