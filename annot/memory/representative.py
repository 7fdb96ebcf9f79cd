"""Trace a few blocks, not all of them (issue #31, "Speed").

A transformer is a stack of identical blocks, and what a training step holds grows by the
same amount per block. So instead of tracing 80 Llama layers under fake tensors, the
longest stack of identical Plan units (an ``nn.ModuleList`` whose children are units of
one class) is cut to 2 and to 3 blocks, each cut model is traced, and the whole model's
figures are the 3-block figures plus one per-block step (3 blocks minus 2) for every
further block:

- totals (peaks, gradient bytes, FLOPs, saved activations) grow linearly in blocks;
- the stretches of a step (`StepTrace.segments`: prefix, block, gap, block, ..., head,
  backward blocks in reverse, embedding) are rebuilt block by block: block ``i``'s
  forward stretch is block 2's plus ``i - 2`` steps, its backward stretch likewise (it
  holds the activations of blocks ``0..i``, whatever follows), the stretches after the
  stack (head, loss) grow with the number of blocks before them;
- a block's own interior (`ActivationEstimate.per_unit`) is the traced one of its
  position: the first, a middle one, the last.

Everything else falls back to tracing the whole model: no stack of at least
`MIN_BLOCKS` identical units, a unit inside a block, stretches that do not repeat
(the cut traces' patterns differ), or a model whose forward fails with fewer blocks
(one that indexes its blocks by a configured count). tests/memory/test_representative.py
checks every figure against the full trace on small models (equal within 0.1%).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from annot.memory.activations import (
    ActivationEstimate,
    InputsFn,
    StepTrace,
    trace_activations,
    trace_step,
)
from annot.policies import Action, Plan

__all__ = ["MIN_BLOCKS", "BlockStack", "block_stack", "cut_model", "fast_trace_activations", "fast_trace_step"]

#: Stacks shorter than this are traced whole (cutting saves nothing).
MIN_BLOCKS = 12
_CUTS = (2, 3)

Segment = tuple[str, int, int, int]


@dataclasses.dataclass(frozen=True)
class BlockStack:
    """The ``nn.ModuleList`` at ``parent`` holding ``count`` Plan units of one class."""

    parent: str
    count: int

    def path(self, i: int) -> str:
        return f"{self.parent}.{i}" if self.parent else str(i)


def block_stack(model: nn.Module, plan: Plan | None) -> BlockStack | None:
    """The longest stack of identical Plan units in ``model``, or ``None`` (see the
    module docstring for what qualifies)."""
    if plan is None:
        return None
    paths = [p for u in plan.units for p in u.modules]
    by_parent: dict[str, list[str]] = {}
    for path in paths:
        parent, _, index = path.rpartition(".")
        if index.isdigit():
            by_parent.setdefault(parent, []).append(path)
    best: BlockStack | None = None
    for parent, members in by_parent.items():
        stack = model.get_submodule(parent)
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) < MIN_BLOCKS:
            continue
        children = list(stack)
        expected = {f"{parent}.{i}" if parent else str(i) for i in range(len(children))}
        if set(members) != expected or len({type(c) for c in children}) != 1:
            continue
        # A unit nested inside a block would be cut away with it: not handled.
        if any(p.startswith(m + ".") for p in paths for m in expected):
            continue
        if best is None or len(children) > best.count:
            best = BlockStack(parent, len(children))
    return best


@contextlib.contextmanager
def _cut(model: nn.Module, plan: Plan, stack: BlockStack, keep: int) -> Iterator[Plan]:
    """``model`` with only the first ``keep`` blocks of ``stack`` (restored after), and
    ``plan`` without the units of the blocks cut away."""
    holder = model.get_submodule(stack.parent)
    original = dict(holder._modules)
    dropped = {stack.path(i) for i in range(keep, stack.count)}
    units = tuple(u for u in plan.units if u.path not in dropped)
    holder._modules = {k: v for k, v in original.items() if int(k) < keep}
    try:
        yield dataclasses.replace(plan, units=units)
    finally:
        holder._modules = original


#: The cut as other modules use it (`annot.memory.budget` profiles 3 blocks so).
cut_model = _cut


def _linear(small: int, large: int, blocks: int) -> int:
    """A total at ``blocks`` from its values at `_CUTS` blocks."""
    return large + (blocks - _CUTS[1]) * (large - small)


def fast_trace_activations(model: nn.Module, plan: Plan | None, *, batch: int, seq: int,
                           dtype: torch.dtype | None = None,
                           inputs: InputsFn | None = None) -> ActivationEstimate:
    """`trace_activations`, from two cut traces when ``model`` has a `block_stack`."""
    stack = block_stack(model, plan)
    if stack is None or plan is None:
        return trace_activations(model, plan, batch=batch, seq=seq, dtype=dtype, inputs=inputs)
    try:
        cut = []
        for keep in _CUTS:
            with _cut(model, plan, stack, keep) as small_plan:
                cut.append(trace_activations(model, small_plan, batch=batch, seq=seq, dtype=dtype,
                                             inputs=inputs))
    except Exception:  # the model needs all its blocks: trace it whole
        return trace_activations(model, plan, batch=batch, seq=seq, dtype=dtype, inputs=inputs)
    two, three = cut
    per_unit = dict(three.per_unit)
    if per_unit:
        middle, last = per_unit.get(stack.path(1)), per_unit.pop(stack.path(2), None)
        for i in range(2, stack.count):
            value = last if i == stack.count - 1 else middle
            if value is not None:
                per_unit[stack.path(i)] = value
        per_unit = dict(sorted(per_unit.items()))
    return ActivationEstimate(
        batch=batch, seq=seq, saved=_linear(two.saved, three.saved, stack.count),
        saved_checkpointed=_linear(two.saved_checkpointed, three.saved_checkpointed, stack.count),
        recompute_peak=max(per_unit.values(), default=0), per_unit=per_unit)


def fast_trace_step(model: nn.Module, plan: Plan | None, *, batch: int, seq: int, checkpoint: bool,
                    dtype: torch.dtype | None = None, autocast: torch.dtype | None = None,
                    inputs: InputsFn | None = None, gpu_rules: bool = False,
                    prepare: Callable[[nn.Module], None] | None = None) -> StepTrace:
    """`trace_step`, from two cut traces when ``model`` has a `block_stack` whose
    stretches repeat. ``prepare`` (`trace_step`'s) sees each cut copy: it must skip the
    paths of blocks cut away and treat every block alike."""
    kwargs: dict[str, Any] = dict(batch=batch, seq=seq, checkpoint=checkpoint, dtype=dtype,
                                  autocast=autocast, inputs=inputs, gpu_rules=gpu_rules,
                                  prepare=prepare)
    stack = block_stack(model, plan)
    if stack is None or plan is None:
        return trace_step(model, plan, **kwargs)
    traces, index_maps = [], []
    try:
        for keep in _CUTS:
            with _cut(model, plan, stack, keep) as small_plan:
                traces.append(trace_step(model, small_plan, **kwargs))
                index_maps.append(_block_of_index(small_plan, stack))
    except Exception:  # the model needs all its blocks: trace it whole
        return trace_step(model, plan, **kwargs)
    segments = _grow_segments(traces[0].segments, traces[1].segments, index_maps[0], index_maps[1],
                              stack, _full_index(plan, stack))
    if segments is None:
        return trace_step(model, plan, **kwargs)
    two, three = traces
    # The peak without gradients is the highest stretch; a total with the gradients is
    # at least that.
    peak = max(top for _, _, top, _ in segments)
    return StepTrace(
        batch=batch, seq=seq, checkpoint=three.checkpoint, peak=peak,
        peak_with_grads=max(peak, _linear(two.peak_with_grads, three.peak_with_grads, stack.count)),
        grads=_linear(two.grads, three.grads, stack.count), segments=segments,
        flops=_linear(two.flops, three.flops, stack.count))


def _shard_paths(plan: Plan) -> list[str]:
    return [u.path for u in plan.units if u.has(Action.SHARD)]


def _block_of_index(plan: Plan, stack: BlockStack) -> dict[int, tuple[str, int | str]]:
    """Shard-unit index of a cut plan -> ("block", i) or ("other", path)."""
    out: dict[int, tuple[str, int | str]] = {}
    for index, path in enumerate(_shard_paths(plan)):
        parent, _, tail = path.rpartition(".")
        out[index] = ("block", int(tail)) if parent == stack.parent and tail.isdigit() else ("other", path)
    return out


def _full_index(plan: Plan, stack: BlockStack) -> dict[tuple[str, int | str], int]:
    """("block", i) or ("other", path) -> shard-unit index in the whole plan."""
    found: dict[tuple[str, int | str], int] = {}
    for index, path in enumerate(_shard_paths(plan)):
        parent, _, tail = path.rpartition(".")
        found[("block", int(tail)) if parent == stack.parent and tail.isdigit() else ("other", path)] = index
    return found


def _grow_segments(two: tuple[Segment, ...], three: tuple[Segment, ...],
                   map_two: dict[int, tuple[str, int | str]], map_three: dict[int, tuple[str, int | str]],
                   stack: BlockStack, full: dict[tuple[str, int | str], int]) -> tuple[Segment, ...] | None:
    """The whole model's stretches from the 2- and 3-block traces' (module docstring), or
    ``None`` when their patterns do not repeat."""
    runs_two, runs_three = _runs(two, map_two), _runs(three, map_three)
    if runs_two is None or runs_three is None:
        return None
    n = stack.count
    out: list[Segment] = []

    def grown(large: list[Any], small: list[Any], steps: int) -> list[Any]:
        """``large`` plus ``steps`` times (``large`` - ``small``), stretch by stretch."""
        if [_shape(x) for x in large] != [_shape(x) for x in small]:
            raise _NoRepeat
        return [(p, w, t + steps * (t - t0), e + steps * (e - e0))
                for (p, w, t, e), (_, _, t0, e0) in zip(large, small, strict=True)]

    def shifted(segments: list[Any], steps: int, step: int) -> list[Any]:
        return [(p, w, t + steps * step, e + steps * step) for p, w, t, e in segments]

    def emit(segments: list[Any], block: int | None = None) -> None:
        for phase, who, top, end in segments:
            if block is not None and who is not None and who[0] == "block":
                who = ("block", block)
            out.append((phase, full[who] if who is not None else -1, top, end))

    try:
        (f_head, f_blocks, f_tail), (b_head, b_blocks, b_tail) = runs_three
        (_, f_small, f_tail_small), (b_head_small, b_small, _) = runs_two
        forward = dict(f_blocks)
        backward = dict(b_blocks)
        if sorted(forward) != [0, 1, 2] or sorted(backward) != [0, 1, 2] or len(f_small) != 2:
            raise _NoRepeat
        # One block's saved bytes: how much later stretches start higher. A gap between
        # blocks moves by it (its own rise over the previous gap also holds the first
        # block's one-time tensors, so it is not the step).
        f_step = forward[2][0][3] - forward[1][0][3]
        b_step = backward[2][0][3] - backward[1][0][3]
        emit(f_head)
        for i in range(n):
            # Own stretch, then the gap to the next block (none after the last).
            own = [forward[min(i, 2)][0]] if i <= 2 else grown(forward[2][:1], forward[1][:1], i - 2)
            emit(own, i)
            if i < n - 1:
                gap = forward[0][1:] if i == 0 else shifted(forward[1][1:], i - 1, f_step)
                emit(gap, i)
        emit(grown(f_tail, f_tail_small, n - 3))
        emit(grown(b_head, b_head_small, n - 3))
        for j in range(n - 1, -1, -1):
            own = [backward[j][0]] if j <= 2 else grown(backward[2][:1], backward[1][:1], j - 2)
            emit(own, j)
            if j > 0:
                gap = backward[1][1:] if j == 1 else shifted(backward[1][1:], j - 1, b_step)
                emit(gap, j)
        emit(b_tail)
    except (_NoRepeat, KeyError):
        return None
    return tuple(out)


def _shape(segment: tuple[str, Any, int, int]) -> tuple[str, Any]:
    """A stretch's phase and who runs, any block standing for every block."""
    phase, who = segment[:2]
    return phase, "block" if who is not None and who[0] == "block" else who


class _NoRepeat(Exception):
    """The cut traces' stretches do not follow one pattern per block."""


def _runs(segments: tuple[Segment, ...], mapping: dict[int, tuple[str, int | str]],
          ) -> list[tuple[list[Any], list[tuple[Any, list[Any]]], list[Any]]] | None:
    """Per phase (forward, backward): the stretches before the stack, each block's
    stretches (its own, then those up to the next block) by block number, and the
    stretches after the last block. ``None`` when a phase visits a block twice or the
    two phases do not split so."""
    labelled = [(p, mapping.get(u) if u >= 0 else None, t, e) for p, u, t, e in segments]
    # The first backward stretch starts backward (recomputation runs inside it).
    split = next((i for i, s in enumerate(labelled) if s[0] == "backward"), None)
    if split is None:
        return None
    out: list[tuple[list[Any], list[tuple[Any, list[Any]]], list[Any]]] = []
    for part in (labelled[:split], labelled[split:]):
        starts = [i for i, s in enumerate(part) if isinstance(s[1], tuple) and s[1][0] == "block"]
        numbers = [part[i][1][1] for i in starts]  # type: ignore[index]
        if len(set(numbers)) != len(numbers):
            return None
        if not starts:
            return None
        head = part[:starts[0]]
        blocks = []
        for k, start in enumerate(starts):
            stop = starts[k + 1] if k + 1 < len(starts) else None
            if stop is None:
                # The last block: its own stretch; what follows is the tail.
                blocks.append((numbers[k], part[start:start + 1]))
            else:
                blocks.append((numbers[k], part[start:stop]))
        tail = part[starts[-1] + 1:]
        out.append((head, blocks, tail))
    return out
