"""The picture of a budget answer (``annot plan --memory --budget SIZE --plot FILE``):
per strategy, one bar of per-GPU memory stacked by kind (parameters, gradients,
optimizer states, engine buffers, activations, reserve, margin) against a line at the
budget, the chosen strategy marked. matplotlib is an optional extra
(``pip install 'annot-train[plot]'``)."""

from __future__ import annotations

from pathlib import Path

from annot.memory.budget import BudgetAnswer
from annot.memory.strategies import MemoryInputError
from annot.policies.plan import format_bytes

__all__ = ["KINDS", "kind_of", "plot_budget", "stacked"]

KINDS: tuple[str, ...] = ("parameters", "gradients", "optimizer states", "engine buffers",
                          "activations", "reserve", "margin")
GiB = 2**30


def kind_of(part: str) -> str:
    """The `KINDS` entry of one `annot.memory.engine_memory.RankMemory` term. FSDP keeps
    its sharded parameters and optimizer states in one term: it counts as optimizer
    states (the larger share under Adam)."""
    name = part.lower()
    if name == "activations":
        return "activations"
    if "optimizer" in name and "temporar" not in name or "fp32 partition" in name:
        return "optimizer states"
    if "grad" in name and "reduce-scatter" not in name:
        return "gradients"
    if "param" in name or name == "buffers":  # the model's own buffers: model state
        return "parameters"
    return "engine buffers"


def stacked(answer: BudgetAnswer) -> dict[str, dict[str, int]]:
    """Per strategy label: bytes per `KINDS` entry (margin and reserve as the answer
    allows them) at that strategy's peak."""
    bars: dict[str, dict[str, int]] = {}
    for fit in answer.strategies:
        kinds = dict.fromkeys(KINDS, 0)
        for part, nbytes in fit.parts.items():
            kinds[kind_of(part)] += nbytes
        counted = sum(kinds.values())
        kinds["reserve"] = answer.reserve
        kinds["margin"] = int(counted * answer.margin)
        bars[fit.label] = kinds
    return bars


def plot_budget(answer: BudgetAnswer, path: str | Path) -> Path:
    """Draw `stacked` into ``path`` (``.png`` or ``.svg``); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise MemoryInputError(f"--plot {path}: give a .png or .svg file name")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemoryInputError(
            "--plot needs matplotlib, an optional extra: pip install 'annot-train[plot]' "
            "(or pip install matplotlib)") from None
    bars = stacked(answer)
    labels = list(bars)
    unit, scale = ("GiB", GiB) if answer.budget_bytes >= GiB else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4.5))
    bottoms = [0.0] * len(labels)
    for kind in KINDS:
        heights = [bars[label][kind] / scale for label in labels]
        ax.bar(labels, heights, bottom=bottoms, label=kind)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.axhline(answer.budget_bytes / scale, color="black", linestyle="--", label="budget")
    chosen = next(i for i, f in enumerate(answer.strategies) if f.key == answer.strategy)
    ax.annotate("chosen", (chosen, bottoms[chosen]), ha="center", va="bottom", fontweight="bold")
    ax.set_ylabel(f"{unit} per GPU")
    ax.set_title(f"{answer.plan.model}: per-GPU memory against {format_bytes(answer.budget_bytes)}")
    ax.tick_params(axis="x", labelrotation=60)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
