"""Tensor parallelism: a plan (`annot.policies.tensor_parallel`) applied with torch's
``parallelize_module`` on the ``"tp"`` dimension of a device mesh.

Each style name of a plan (transformers' vocabulary) becomes a torch ``ParallelStyle``
(`torch_style`); annot writes no collective of its own. What the tensor-parallel size
must divide is checked before the model changes (`check_tensor_parallel`): the split
dimension of every Linear and Embedding, and the head counts of the attention modules
whose projections are split. FSDP2 applies this before sharding (torchtitan's order,
`annot.engines.fsdp2`), on the mesh's ``"tp"`` dimension, and shards over the others.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from annot.policies.errors import PlanError
from annot.policies.tensor_parallel import TensorParallelRule, resolve_tp_plan

__all__ = [
    "TP_DIM",
    "TensorParallelPlan",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "torch_style",
]

#: The name of the tensor-parallel dimension of a device mesh (the innermost one).
TP_DIM = "tp"

# Attribute names that hold a count of attention heads (n_head, num_heads,
# num_attention_heads, num_key_value_heads, n_kv_heads, ...).
_HEAD_COUNT = re.compile(r"(?:n|num)_(?:\w+_)?heads?")

TPSource = TensorParallelRule | Mapping[str, str] | None


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """A resolved plan: module path -> style, and the head-count attributes to divide
    (module path -> attribute names)."""

    styles: dict[str, str]
    local_heads: dict[str, tuple[str, ...]]


def torch_style(style: str) -> ParallelStyle:
    """torch's ``ParallelStyle`` for a style name of the plan vocabulary
    (`annot.policies.tensor_parallel.STYLES`). Every output is a plain local tensor, so
    the model's own forward code runs between the split layers unchanged."""
    styles: dict[str, ParallelStyle] = {
        # Inputs replicated; weight and bias split by output features (dim 0).
        "colwise": ColwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        # Weight split by input features (dim 1), bias whole; partial sums all-reduced.
        "rowwise": RowwiseParallel(),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        # torch's styles on an Embedding: rowwise splits the vocabulary (masked lookups
        # summed), colwise the hidden size (gathered).
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": ColwiseParallel(output_layouts=Replicate()),
    }
    if style not in styles:
        raise PlanError(f"no torch style for tensor-parallel style {style!r}")
    return styles[style]


def check_tensor_parallel(model: nn.Module, source: TPSource, tp: int) -> TensorParallelPlan:
    """Resolve the plan for ``model`` and refuse what ``tp`` ranks cannot split evenly,
    before anything changes. Raises `PlanError` naming the module and the fix."""
    styles = resolve_tp_plan(model, source)
    named_heads = source.local_heads if isinstance(source, TensorParallelRule) else ()
    problems: list[str] = []
    for path, style in styles.items():
        problems += _split_problems(path, model.get_submodule(path), style, tp)
    problems += _tied_problems(model, styles)
    local_heads: dict[str, tuple[str, ...]] = {}
    for parent in sorted({path.rpartition(".")[0] for path in styles}):
        module = model.get_submodule(parent)
        counts = _head_counts(module)
        for name, value in counts.items():
            if value % tp:
                problems.append(f"{parent or '(root)'} ({type(module).__name__}) has "
                                f"{name}={value} heads, not divisible by tp={tp}")
        if isinstance(source, TensorParallelRule):
            unnamed = sorted(n for n in counts if n not in named_heads)
            if unnamed:
                problems.append(
                    f"{parent or '(root)'} ({type(module).__name__}) carries head count(s) "
                    f"{', '.join(f'{n}={counts[n]}' for n in unnamed)} and its Linear layers are "
                    "split: if forward reshapes by it, each rank would mix its heads silently. "
                    f"Pass tp_rule(..., local_heads={unnamed}) to have annot set it to the "
                    "per-rank count, or leave this module's layers out of the rule")
            owned = tuple(n for n in named_heads if n in counts)
            if owned:
                local_heads[parent] = owned
        # transformers' attention modules read their head counts from the config and
        # reshape with -1 (local heads); the counts must still divide evenly.
        config = getattr(module, "config", None)
        if config is not None and re.search(r"Attention|Attn", type(module).__name__):
            for name in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, name, None)
                if isinstance(heads, int) and heads % tp:
                    problems.append(f"{parent} ({type(module).__name__}): config.{name}={heads} "
                                    f"is not divisible by tp={tp}")
    if problems:
        shown = list(dict.fromkeys(problems))  # layers repeat: say each thing once
        raise PlanError(f"tensor parallelism over {tp} ranks cannot split this model: "
                        + "; ".join(shown[:4]) + (f"; and {len(shown) - 4} more" if len(shown) > 4 else ""))
    return TensorParallelPlan(styles, local_heads)


def _split_problems(path: str, module: nn.Module, style: str, tp: int) -> list[str]:
    label = f"{path} ({type(module).__name__})"
    if style.startswith("embedding"):
        if not isinstance(module, nn.Embedding):
            return [f"{label} is not an nn.Embedding, which style {style!r} splits"]
        size = module.num_embeddings if style == "embedding_rowwise" else module.embedding_dim
        what = "num_embeddings" if style == "embedding_rowwise" else "embedding_dim"
    else:
        if not isinstance(module, nn.Linear):
            return [f"{label} is not an nn.Linear, which style {style!r} splits (torch's "
                    "tensor-parallel styles take Linear and Embedding layers)"]
        rowwise = style.startswith("rowwise")
        size = module.in_features if rowwise else module.out_features
        what = "in_features" if rowwise else "out_features"
    if size % tp:
        return [f"{label} has {what}={size}, not divisible by tp={tp}"]
    return []


def _tied_problems(model: nn.Module, styles: Mapping[str, str]) -> list[str]:
    """A parameter shared by a split module and another module would be split in one and
    whole in the other: the tie breaks (docs/design.md, pitfall 2)."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    problems = []
    for names in owners.values():
        split = [n for n in names if n.rpartition(".")[0] in styles]
        if split and len(names) > 1:
            problems.append(f"{', '.join(names)} are one tied parameter but only "
                            f"{', '.join(split)} would be split: leave its modules out of "
                            "the plan (or untie them)")
    return problems


def _head_counts(module: nn.Module) -> dict[str, int]:
    return {name: value for name, value in vars(module).items()
            if _HEAD_COUNT.fullmatch(name) and isinstance(value, int) and not isinstance(value, bool)}


def apply_tensor_parallel(model: nn.Module, plan: TensorParallelPlan, tp_mesh: DeviceMesh) -> None:
    """Split ``model``'s modules in place as ``plan`` says, over ``tp_mesh`` (1-D).

    Parameters become DTensors on ``tp_mesh``; each rank keeps its share of the values it
    already holds (every rank built the same model, as FSDP2 assumes too), so nothing is
    sent. A model on the meta device stays there, with its shares' shapes."""
    parallelize_module(model, tp_mesh, {path: torch_style(style) for path, style in plan.styles.items()},
                       src_data_rank=None)
    tp = tp_mesh.size()
    for path, names in plan.local_heads.items():
        module = model.get_submodule(path)
        for name in names:
            setattr(module, name, getattr(module, name) // tp)
