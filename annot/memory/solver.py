"""The exact choice of one option per block under prefix-sum memory limits.

The problem `annot.memory.budget` reduces each strategy to: blocks ``0..n-1`` in forward
order, each with options ``c`` holding ``held[i][c]`` bytes from its forward to its
backward and costing ``cost[i][c]`` seconds. With ``S_i`` the bytes held by blocks before
``i``, the peak while backward runs block ``i`` is ``S_i`` plus terms that do not depend
on the choices, so the budget becomes ``S_i <= limits[i]`` for every ``i`` and
``S_n <= final`` (the end of forward). Minimise the total cost.

Dynamic programming over the blocks, keeping for each prefix the Pareto front of
(held bytes, cost): a prefix that holds more and costs no less can never lead to a
better answer, because every limit bounds the held bytes from above and the cost adds
up. The front is exact (no rounding of bytes) while it holds at most `FRONT_CAP` points,
which identical blocks (a transformer's) keep to (128 such blocks with 5 options: 167
points at most, 0.09 s on a loaded 2-core machine: examples/bench_budget.py --solver).
Blocks that all differ can grow the front without bound (128 random blocks: 1.4 s with
the cap reached, the exact answer's cost all the same); beyond the cap, points whose
held bytes fall in the same of `FRONT_CAP` equal slices of the front's range keep only
the cheapest. Each point keeps its true held bytes, so an answer is never over a limit;
only a slightly cheaper one may be missed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["FRONT_CAP", "solve"]

#: Points kept per prefix before nearby ones are merged (module docstring).
FRONT_CAP = 4096


def solve(held: Sequence[Sequence[float]], cost: Sequence[Sequence[float]],
          limits: Sequence[float], final: float) -> tuple[float, list[int]] | None:
    """(least total cost, option index per block) under the limits (module docstring),
    or ``None`` when no assignment fits. An option of cost ``inf`` is never taken; ties
    go to the assignment holding less, then to earlier options."""
    n = len(held)
    if not (len(cost) == len(limits) == n):
        raise ValueError("held, cost and limits need one entry per block")
    # The front of the prefix: held bytes and cost of each point; per step, each new
    # point's index into the previous front and its option (for the way back).
    front_held, front_cost = np.zeros(1), np.zeros(1)
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    for i in range(n):
        alive = np.flatnonzero(front_held <= limits[i])
        if alive.size == 0:
            return None
        h, c = np.asarray(held[i], dtype=float), np.asarray(cost[i], dtype=float)
        options = np.flatnonzero(np.isfinite(c))
        grown_held = (front_held[alive][:, None] + h[options][None, :]).ravel()
        grown_cost = (front_cost[alive][:, None] + c[options][None, :]).ravel()
        parent = np.repeat(alive, options.size)
        option = np.tile(options, alive.size)
        keep = _pareto(grown_held, grown_cost, option)
        front_held, front_cost = grown_held[keep], grown_cost[keep]
        steps.append((parent[keep], option[keep]))
    done = np.flatnonzero(front_held <= final)
    if done.size == 0:
        return None
    k = int(done[np.lexsort((front_held[done], front_cost[done]))[0]])
    total = float(front_cost[k])
    picks: list[int] = []
    for parent, option in reversed(steps):
        picks.append(int(option[k]))
        k = int(parent[k])
    return total, picks[::-1]


def _pareto(held: np.ndarray, cost: np.ndarray, option: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats in both held bytes and cost (merged
    to `FRONT_CAP` slices beyond it), in increasing held bytes."""
    order = np.lexsort((option, cost, held))
    sorted_cost = cost[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], sorted_cost[:-1])))
    kept = order[sorted_cost < best_before]
    if kept.size <= FRONT_CAP:
        return kept
    low, high = held[kept[0]], held[kept[-1]]
    slices = np.minimum(((held[kept] - low) / (high - low) * FRONT_CAP).astype(np.int64), FRONT_CAP - 1)
    # Cost falls as held bytes rise along the front: the last point of a slice is its cheapest.
    last = np.flatnonzero(np.append(slices[1:] != slices[:-1], True))
    return kept[last]
