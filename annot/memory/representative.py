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

That holds where every block of the stack carries the same Plan unit (`_kind`: class,
sizes, and, where the trace applies them, checkpoint, selective policy and offload). A step
whose blocks differ (the budget's answers mix choices: some blocks ``none``, some
``selective``, ...) is traced from one cut model instead (`_mixed_trace_step`), issue #31:

- the stack is read as runs of blocks of one kind; a run of at least `LONG_RUN` blocks
  keeps its first two, its third and its last two blocks, a shorter run every block, so
  every block kept has the neighbours it has in the whole model;
- a block cut away stands inside its run, two blocks or more from either end, like
  the run's third block in the cut model; what it adds to each stretch it runs in (live
  bytes, the most live bytes with gradients, gradients, FLOPs: each relative to where
  the stretch before it ended) is the third block's. The whole step is every block's
  increments laid out in the whole model's order and summed (a block's backward stretch
  also holds the recomputation of the block below it, which is why neighbours are kept);
- that a block's increments do not depend on blocks further away is checked, not
  assumed: the second, third and next-to-last blocks of each long run (the second's
  neighbour two below and the next-to-last's two above are another run's) must add
  exactly the same, else the whole model is traced.

Everything else falls back to tracing the whole model: no stack of at least
`MIN_BLOCKS` identical units, a unit inside a block, stretches that do not repeat
(the cut traces' patterns differ), a model whose forward fails with fewer blocks
(one that indexes its blocks by a configured count), a config listing per-block types
that differ (`_positional`), and, for mixed steps, no run long enough to cut.
tests/memory/test_representative.py and test_representative_mixed.py check every
figure against the full trace on small models (equal within 0.1%).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from annot.memory.activations import (
    ActivationEstimate,
    InputsFn,
    SegmentCounts,
    StepTrace,
    trace_activations,
    trace_step,
)
from annot.policies import Action, Plan
from annot.policies.plan import Unit

__all__ = ["LONG_RUN", "MIN_BLOCKS", "BlockStack", "block_stack", "cut_model", "fast_trace_activations",
           "fast_trace_step"]

#: Stacks shorter than this are traced whole (cutting saves nothing).
MIN_BLOCKS = 12
_CUTS = (2, 3)
#: Runs of blocks of one kind at least this long are cut to 5 blocks in a mixed step
#: (first two, third, last two); shorter ones are kept whole.
LONG_RUN = 6

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
    with _kept(model, plan, stack, range(keep)) as small:
        yield small


@contextlib.contextmanager
def _kept(model: nn.Module, plan: Plan, stack: BlockStack, keep: Iterable[int]) -> Iterator[Plan]:
    """``model`` with only the blocks ``keep`` of ``stack``, in order and under their
    own names (so the Plan's paths still find them; restored after), and ``plan``
    without the units of the blocks cut away."""
    holder = model.get_submodule(stack.parent)
    original = dict(holder._modules)
    kept = {str(i) for i in keep}
    dropped = {stack.path(i) for i in range(stack.count) if str(i) not in kept}
    units = tuple(u for u in plan.units if u.path not in dropped)
    holder._modules = {k: v for k, v in original.items() if k in kept}
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
    if (stack is None or plan is None or len(_block_runs(plan, stack, applied=True)) != 1
            or _positional(model, stack)):
        # Blocks checkpointed differently, or described one by one in the config: the
        # cut blocks would not stand for the rest.
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
        recompute_peak=max(per_unit.values(), default=0), per_unit=per_unit,
        assumption=two.assumption or three.assumption)


def fast_trace_step(model: nn.Module, plan: Plan | None, *, batch: int, seq: int, checkpoint: bool,
                    dtype: torch.dtype | None = None, autocast: torch.dtype | None = None,
                    inputs: InputsFn | None = None, gpu_rules: bool = False,
                    prepare: Callable[[nn.Module], None] | None = None,
                    float8_gathered: bool = False) -> StepTrace:
    """`trace_step`, from cut traces when ``model`` has a `block_stack` whose stretches
    repeat: two (2 and 3 blocks) where every block's unit is alike, one
    (`_mixed_trace_step`) where runs of blocks differ. ``prepare`` (`trace_step`'s) sees
    each cut copy: it must skip the paths of blocks cut away, and what it installs on a
    block must follow from that block's unit in ``plan`` alone (so blocks of one kind
    are alike)."""
    kwargs: dict[str, Any] = dict(batch=batch, seq=seq, checkpoint=checkpoint, dtype=dtype,
                                  autocast=autocast, inputs=inputs, gpu_rules=gpu_rules,
                                  prepare=prepare, float8_gathered=float8_gathered)
    stack = block_stack(model, plan)
    # A config describing blocks one by one: a cut's blocks would read other blocks' entries.
    if stack is None or plan is None or _positional(model, stack):
        return trace_step(model, plan, **kwargs)
    runs = _block_runs(plan, stack, applied=checkpoint or prepare is not None)
    if len(runs) > 1:
        return _mixed_trace_step(model, plan, stack, runs, kwargs)
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
        flops=_linear(two.flops, three.flops, stack.count), assumption=two.assumption or three.assumption,
        root_grads_last=three.root_grads_last)


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


def _shape(segment: tuple[Any, ...]) -> tuple[str, Any]:
    """A stretch's phase and who runs, any block standing for every block."""
    phase, who = segment[:2]
    return phase, "block" if who is not None and who[0] == "block" else who


class _NoRepeat(Exception):
    """The cut traces' stretches do not follow one pattern per block."""


def _runs(segments: tuple[Segment, ...], mapping: dict[int, tuple[str, int | str]],
          ) -> list[tuple[list[Any], list[tuple[Any, list[Any]]], list[Any]]] | None:
    """`_split` of ``segments``, each labelled by who runs (`_block_of_index`)."""
    return _split([(p, mapping.get(u) if u >= 0 else None, t, e) for p, u, t, e in segments])


def _split(labelled: list[tuple[Any, ...]],
           ) -> list[tuple[list[Any], list[tuple[Any, list[Any]]], list[Any]]] | None:
    """Per phase (forward, backward) of stretches labelled ``(phase, who, ...)``: the
    stretches before the stack, each block's stretches (its own, then those up to the
    next block) by block number, and the stretches after the last block. ``None`` when
    a phase visits a block twice or the two phases do not split so."""
    # The first backward stretch starts backward (recomputation runs inside it).
    split = next((i for i, s in enumerate(labelled) if s[0] == "backward"), None)
    if split is None:
        return None
    out: list[tuple[list[Any], list[tuple[Any, list[Any]]], list[Any]]] = []
    for part in (labelled[:split], labelled[split:]):
        starts = [i for i, s in enumerate(part) if isinstance(s[1], tuple) and s[1][0] == "block"]
        numbers = [part[i][1][1] for i in starts]
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


# -- steps whose blocks differ ---------------------------------------------------------

#: One block's unit as a trace sees it (`_kind`).
Kind = tuple[Any, ...]
#: A stretch of a cut trace, labelled and relative to where the one before it ended:
#: (phase, who, top, end, top with gradients, gradients added, FLOPs added); ``who`` is
#: ``None`` (outside every shard unit), ("block", i) or ("other", path).
_Delta = tuple[str, Any, int, int, int, int, int]


def _kind(unit: Unit | None, applied: bool) -> Kind | None:
    """What a trace of block ``unit`` depends on beside its path: its class, sizes,
    trainable count and actions; its checkpoint and offload choice only where the trace
    applies them (``applied``: `trace_step`'s ``checkpoint`` or ``prepare``)."""
    if unit is None:
        return None
    actions = tuple(a for a in unit.actions if applied or a not in (Action.CHECKPOINT, Action.OFFLOAD))
    choice = (unit.checkpoint_policy, unit.offload_activations, unit.offload_to) if applied else ()
    return (unit.cls, unit.params, tuple(sorted(unit.bytes.items())), unit.trainable, bool(unit.group),
            actions, *choice)


def _block_runs(plan: Plan, stack: BlockStack, *, applied: bool) -> list[tuple[int, int]]:
    """The stack's blocks as runs ``(start, stop)`` of one `_kind` each, in order."""
    units = {u.path: u for u in plan.units}
    kinds = [_kind(units.get(stack.path(i)), applied) for i in range(stack.count)]
    runs: list[tuple[int, int]] = []
    for i, kind in enumerate(kinds):
        if runs and kinds[runs[-1][0]] == kind:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _sources(runs: list[tuple[int, int]]) -> list[int]:
    """For each block of the whole stack, the block of the cut model that stands for it:
    itself where kept, else the third block of its run (module docstring)."""
    source: list[int] = []
    for start, stop in runs:
        for i in range(start, stop):
            inside = stop - start >= LONG_RUN and start + 2 < i < stop - 2
            source.append(start + 2 if inside else i)
    return source


def _witnesses(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Per long run, the blocks whose increments must agree for its cut to stand: the
    second (its neighbour two below is another run's, or none), the third (the one the
    blocks cut away copy) and the next to last (its neighbour two above is another
    run's, or none)."""
    return [(start + 1, start + 2, stop - 2) for start, stop in runs if stop - start >= LONG_RUN]


def _mixed_trace_step(model: nn.Module, plan: Plan, stack: BlockStack, runs: list[tuple[int, int]],
                      kwargs: dict[str, Any]) -> StepTrace:
    """`trace_step` of a step whose blocks differ, from one trace of the stack cut to the
    blocks `_sources` keeps (module docstring); traced whole where that cut keeps every
    block, the model's forward fails without the blocks cut away, or the cut trace's
    stretches do not follow the pattern (`_rebuild`). The caller has refused configs
    that describe blocks one by one (`_positional`)."""
    source = _sources(runs)
    kept = sorted(set(source))
    if len(kept) == stack.count:
        return trace_step(model, plan, **kwargs)
    counts: list[SegmentCounts] = []
    try:
        with _kept(model, plan, stack, kept) as small_plan:
            cut = trace_step(model, small_plan, **kwargs, counts=counts)
            mapping = _block_of_index(small_plan, stack)
    except Exception:  # the model needs all its blocks: trace it whole
        return trace_step(model, plan, **kwargs)
    rebuilt = _rebuild(cut, counts, mapping, source, _witnesses(runs), _full_index(plan, stack))
    return rebuilt if rebuilt is not None else trace_step(model, plan, **kwargs)


def _positional(model: nn.Module, stack: BlockStack) -> bool:
    """Whether ``model``'s config describes its blocks one by one and not all alike (a
    ``layer_types`` of sliding and full attention, say). A forward may read such a list
    by a block's place in the loop (``config.layer_types[i]``), and a kept block of the
    cut model is not at its place in the whole model, so it would read another block's
    entry."""
    config = getattr(model, "config", None)
    values = vars(config).values() if config is not None and hasattr(config, "__dict__") else ()
    return any(isinstance(v, (list, tuple)) and len(v) == stack.count and len({repr(x) for x in v}) > 1
               for v in values)


def _deltas(trace: StepTrace, counts: list[SegmentCounts],
            mapping: dict[int, tuple[str, int | str]]) -> list[_Delta] | None:
    """``trace``'s stretches as `_Delta`s, or ``None`` when its counts do not add up to
    its totals (then the rebuild's sums would not either)."""
    if len(counts) != len(trace.segments) or not counts:
        return None
    out: list[_Delta] = []
    end = grads = flops = 0
    for (phase, unit, top, stop), c in zip(trace.segments, counts, strict=True):
        who = mapping.get(unit) if unit >= 0 else None
        out.append((phase, who, top - end, stop - end, c.top_all - end - grads, c.grads - grads, c.flops - flops))
        end, grads, flops = stop, c.grads, c.flops
    consistent = (max(s[2] for s in trace.segments) == trace.peak
                  and max(c.top_all for c in counts) == trace.peak_with_grads
                  and (grads, flops) == (trace.grads, trace.flops))
    return out if consistent else None


def _rebuild(cut: StepTrace, counts: list[SegmentCounts], mapping: dict[int, tuple[str, int | str]],
             source: list[int], witnesses: list[tuple[int, int, int]],
             full: dict[tuple[str, int | str], int]) -> StepTrace | None:
    """The whole step from the cut trace ``cut`` (module docstring): every block's
    stretches are those of its ``source`` block, summed in the whole model's order.
    ``None`` when the cut's stretches do not split per block, visit the kept blocks out
    of order, or the ``witnesses`` of a run add different amounts."""
    deltas = _deltas(cut, counts, mapping)
    parts = _split(deltas) if deltas is not None else None
    if parts is None:
        return None
    (f_head, f_blocks, f_tail), (b_head, b_blocks, b_tail) = parts
    kept = sorted(set(source))
    if [n for n, _ in f_blocks] != kept or [n for n, _ in b_blocks] != kept[::-1]:
        return None
    forward, backward = dict(f_blocks), dict(b_blocks)
    for blocks in (forward, backward):
        for trio in witnesses:
            if len({tuple(_relative(blocks[i])) for i in trio}) != 1:
                return None
    n = len(source)
    laid_out = [*f_head, *(_as_block(s, k) for k in range(n) for s in forward[source[k]]), *f_tail,
                *b_head, *(_as_block(s, k) for k in reversed(range(n)) for s in backward[source[k]]), *b_tail]
    try:
        return _summed(laid_out, cut, full)
    except KeyError:  # a stretch of a unit the whole Plan lacks
        return None


def _relative(segments: list[_Delta]) -> list[tuple[Any, ...]]:
    """Stretches compared across blocks: who runs (any block standing for every block)
    and what each adds."""
    return [(*_shape(s), *s[2:]) for s in segments]


def _as_block(segment: _Delta, block: int) -> _Delta:
    """``segment`` as block ``block``'s (stretches of other units left as they are)."""
    phase, who, *rest = segment
    if who is not None and who[0] == "block":
        who = ("block", block)
    return (phase, who, *rest)


def _summed(laid_out: list[_Delta], cut: StepTrace, full: dict[tuple[str, int | str], int]) -> StepTrace:
    """The `StepTrace` whose stretches add ``laid_out``'s increments in order (the
    inverse of `_deltas`, on the whole Plan's unit indices)."""
    segments: list[Segment] = []
    end = grads = flops = peak_with_grads = 0
    for phase, who, top, stop, top_all, added_grads, added_flops in laid_out:
        peak_with_grads = max(peak_with_grads, end + grads + top_all)
        segments.append((phase, full[who] if who is not None else -1, end + top, end + stop))
        end, grads, flops = end + stop, grads + added_grads, flops + added_flops
    return StepTrace(batch=cut.batch, seq=cut.seq, checkpoint=cut.checkpoint,
                     peak=max(s[2] for s in segments), peak_with_grads=peak_with_grads, grads=grads,
                     segments=tuple(segments), flops=flops, assumption=cut.assumption,
                     root_grads_last=cut.root_grads_last)
