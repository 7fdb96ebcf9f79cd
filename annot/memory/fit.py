"""`largest_fit`: the largest model of a family, and the largest micro-batch, that each
strategy fits on the given GPUs and host memory.

A family is a function from one integer (layers, width, ...) to a model on the meta
device. Memory grows about linearly in layers and in batch (states, kept activations),
so each search evaluates two points, solves the line for the limit, then checks the
answer with the planner itself and moves one step at a time (or bisects) until the
answer fits and the next value does not. Every figure it reports is a full planner
evaluation (`estimate_memory`'s per-strategy figure, margin and reserve included), never
the line.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from annot.memory.activations import InputsFn, StepTrace, trace_step
from annot.memory.engine_memory import ModelFacts, model_facts
from annot.memory.report import MARGIN, RESERVE, _trace_setting, strategy_memory
from annot.memory.strategies import Strategy, strategy
from annot.policies import Action, Plan, make_plan
from annot.policies.plan import format_bytes
from annot.policies.rules import format_count

__all__ = ["FitAnswer", "largest_fit"]

#: The largest family value or batch searched.
SEARCH_LIMIT = 1 << 16


@dataclasses.dataclass(frozen=True)
class FitAnswer:
    """For one strategy: the largest ``value`` of the family that fits (``None``: not even
    the smallest), its parameter count and counted per-GPU peak, and the largest
    micro-batch at the family member ``at`` (``None``: not even 1)."""

    key: str
    label: str
    value: int | None
    params: int | None
    gpu: int | None
    at: int
    batch: int | None


def largest_fit(
    build: Callable[[int], nn.Module],
    at: int,
    *,
    keys: Sequence[str] = ("ddp", "zero3", "zero3-offload"),
    plan_of: Callable[[nn.Module], Plan] | None = None,
    gpus: int = 8,
    nodes: int = 1,
    batch: int = 1,
    seq: int = 2048,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    gpu_mem: int,
    host_mem: int,
    margin: float = MARGIN,
    reserve: int = RESERVE,
    checkpoint: bool = True,
    inputs: InputsFn | None = None,
) -> list[FitAnswer]:
    """Per strategy in ``keys``: the largest ``v`` such that ``build(v)`` (a meta model)
    fits at ``batch`` x ``seq``, and the largest batch for ``build(at)``. With
    ``checkpoint``, the Plan's checkpointing is on (what a user squeezing memory runs)."""
    chosen = [strategy(k) for k in keys]
    plan_of = plan_of or make_plan
    built: dict[int, tuple[nn.Module, Plan, ModelFacts]] = {}
    traces: dict[tuple[Any, ...], StepTrace] = {}
    cache: dict[tuple[str, int, int], tuple[bool, int, int, float]] = {}

    def evaluate(s: Strategy, value: int, micro: int) -> tuple[bool, int, int, float]:
        """(fits, device bytes, params, share of the binding limit used) of ``s`` for
        build(value) at batch ``micro``; traces are shared between strategies."""
        if (s.key, value, micro) not in cache:
            if value not in built:
                model = build(value)
                plan = plan_of(model)
                built[value] = (model, plan, model_facts(model, plan))
            model, plan, facts = built[value]
            ckpt = checkpoint and bool(plan.paths(Action.CHECKPOINT))
            dtype, autocast = _trace_setting(s, precision)
            setting = (dtype, autocast, ckpt)
            if (value, micro, *setting) not in traces:
                traces[(value, micro, *setting)] = trace_step(
                    model, plan, batch=micro, seq=seq, checkpoint=ckpt, dtype=dtype,
                    autocast=autocast, inputs=inputs)
            m = strategy_memory(s, traces[(value, micro, *setting)], facts, plan,
                                world=gpus * nodes, precision=precision, optimizer=optimizer)
            host_share = 0.0 if s.option("offload") == "nvme" else m.host * gpus / host_mem
            share = max((m.device * (1 + margin) + reserve) / gpu_mem, host_share)
            cache[(s.key, value, micro)] = (share <= 1, m.device, facts.params, share)
        return cache[(s.key, value, micro)]

    answers = []
    for s in chosen:
        value = _search(functools.partial(_at_batch, evaluate, s, batch), start=max(1, at // 2))
        micro = _search(functools.partial(_at_value, evaluate, s, at), start=1)
        fits_at = evaluate(s, value, batch) if value is not None else None
        answers.append(FitAnswer(
            key=s.key, label=s.label, value=value, params=fits_at[2] if fits_at else None,
            gpu=fits_at[1] if fits_at else None, at=at, batch=micro))
    return answers


Probe = tuple[bool, int, int, float]


def _at_batch(evaluate: Callable[[Strategy, int, int], Probe], s: Strategy, micro: int, value: int) -> Probe:
    return evaluate(s, value, micro)


def _at_value(evaluate: Callable[[Strategy, int, int], Probe], s: Strategy, value: int, micro: int) -> Probe:
    return evaluate(s, value, micro)


def _search(probe: Callable[[int], tuple[bool, int, int, float]], start: int) -> int | None:
    """The largest v >= 1 with ``probe(v)[0]``, fitting being monotone in v. ``probe``'s
    last field is the share of the binding limit used (<= 1 when it fits); the line
    through two probes guesses where it reaches 1, then probes settle it."""
    first = probe(start)
    if not first[0]:
        return _bisect(probe, 0, start) if start > 1 else None
    lo, lo_share = start, first[3]
    hi: int | None = None
    second = probe(2 * start)
    if second[0]:
        lo, prev, prev_share = 2 * start, start, lo_share
        lo_share = second[3]
        while hi is None and lo < SEARCH_LIMIT:
            slope = (lo_share - prev_share) / (lo - prev)
            guess = lo + max(1, int((1 - lo_share) / slope)) if slope > 0 else 2 * lo
            guess = min(guess, SEARCH_LIMIT)
            result = probe(guess)
            if result[0]:
                prev, prev_share, lo, lo_share = lo, lo_share, guess, result[3]
            else:
                hi = guess
        if hi is None:
            return lo
    else:
        hi = 2 * start
    # The line's guess missed by a little: walk down from just below the miss first.
    if hi - 1 > lo and probe(hi - 1)[0]:
        return hi - 1
    return _bisect(probe, lo, hi - 1)


def _bisect(probe: Callable[[int], tuple[bool, int, int, float]], lo: int, hi: int) -> int | None:
    """Largest v in (lo, hi) that fits, given ``lo`` fits (0: nothing known) and ``hi``
    does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid)[0]:
            lo = mid
        else:
            hi = mid
    return lo or None


def format_fit(answers: list[FitAnswer], knob: str) -> str:
    """The ``--fit`` table."""
    header = ("strategy", f"largest {knob}", "params", "GPU peak", f"largest batch at {knob}={answers[0].at}")
    rows = [(a.label, str(a.value) if a.value else "none", format_count(a.params) if a.params else "-",
             format_bytes(a.gpu) if a.gpu else "-", str(a.batch) if a.batch else "none") for a in answers]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])
