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
up. The front is exact (no rounding of bytes); for identical blocks it stays small
(128 blocks, 5 options: well under a second, tests/memory/test_budget.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["solve"]


def solve(held: Sequence[Sequence[float]], cost: Sequence[Sequence[float]],
          limits: Sequence[float], final: float) -> tuple[float, list[int]] | None:
    """(least total cost, option index per block) under the limits (module docstring),
    or ``None`` when no assignment fits. An option of cost ``inf`` is never taken; ties
    go to the assignment holding less, then to earlier options."""
    n = len(held)
    if not (len(cost) == len(limits) == n):
        raise ValueError("held, cost and limits need one entry per block")
    # front: (held so far, cost so far, index into the previous front, option)
    front: list[tuple[float, float, int, int]] = [(0.0, 0.0, -1, -1)]
    history: list[list[tuple[float, float, int, int]]] = []
    for i in range(n):
        alive = [(k, point) for k, point in enumerate(front) if point[0] <= limits[i]]
        if not alive:
            return None
        grown = [(s + held[i][c], total + cost[i][c], k, c)
                 for k, (s, total, _, _) in alive
                 for c in range(len(held[i])) if math.isfinite(cost[i][c])]
        history.append(front)
        front = _pareto(grown)
    history.append(front)
    done = [(total, s, k) for k, (s, total, _, _) in enumerate(front) if s <= final]
    if not done:
        return None
    total, _, k = min(done)
    picks: list[int] = []
    for step in range(n, 0, -1):
        _, _, parent, option = history[step][k]
        picks.append(option)
        k = parent
    return total, picks[::-1]


def _pareto(points: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The points no other point beats in both held bytes and cost."""
    points.sort(key=lambda p: (p[0], p[1], p[3]))
    kept: list[tuple[float, float, int, int]] = []
    best = math.inf
    for point in points:
        if point[1] < best:
            kept.append(point)
            best = point[1]
    return kept
