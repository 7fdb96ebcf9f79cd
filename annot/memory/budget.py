"""`fit_budget`: the strategy and, per block, the activation choice
(`annot.memory.choices`) that train fastest within a memory budget per GPU.

For each strategy annot builds (the outer loop), two traces of the step (made once per
trace setting) give the model: one forward that profiles each block
(`annot.memory.choices.profile_blocks`: what it saves, its input, its matmul outputs,
its FLOPs) and the plain training step (`trace_step`), whose stretches (forward and
backward of each shard unit, outside them) are each joined with what the engine holds
then (`annot.memory.engine_memory`: model states, buffers, gathered parameters,
gradients so far; `BudgetSolver.points`, read from one evaluation of the engine model
per strategy: `BudgetSolver._engine_at`). So the peak is checked at the end of forward
and at every stretch of backward, each with the engine's memory at that moment, and
with every block at ``none`` the model gives the traced peak exactly (tested).
`annot.memory.solver` then picks the choices exactly (dynamic programming over the
blocks) so that every such point fits, at the least added time. The strategy with the
shortest predicted step wins (ties: the order of
`annot.memory.strategies.STRATEGIES`, simplest first).

The answer is then traced as it will run (its Plan's checkpointing, selective contexts
and offload under ``FakeTensorMode``; from a model cut to a few blocks of each run of one
choice, `annot.memory.representative.fast_trace_step`), and ``peak_bytes`` is that
traced figure; where
it exceeds what the per-block model said, the choice is made again with the
difference taken off the budget. The solver's feasible set only grows with the budget,
but that re-solve does not: at a large budget the first answer can be far over and the
tighter limit fall below what a smaller budget's first answer fitted (the Llama-3-8B
sweep's step rose at 80 GiB so). So every traced answer is kept (`BudgetSolver._found`)
and a budget's answer is the fastest traced answer that fits it, whichever budget it
was found for: over the budgets one solver is asked in increasing order (the sweeps,
the picture), a larger budget never gives a slower predicted step, by construction
(tests/memory/test_budget_monotone.py makes the model short on purpose).

``peak_bytes`` is the counted per-GPU peak (what `annot.memory.counting.LiveBytes` counts
in a real run); the budget must hold it times ``1 + margin`` plus ``reserve`` (the
allowances of `annot.memory.report`). Predicted step time: the strategy's step
(`annot.memory.report.step_time`, collectives overlapping compute) plus what the choices
add (`choice_seconds`), not assumed to hide behind collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from annot.memory.activations import InputsFn, StepTrace, trace_step
from annot.memory.choices import (
    CHOICES,
    GB,
    OFFLOAD_CHOICES,
    BlockProfile,
    Device,
    choice_seconds,
    device,
    held,
    profile_blocks,
)
from annot.memory.communication import INTER_NODE_BW, INTRA_NODE_BW, Network
from annot.memory.context_parallel import AttentionShape, attention_shape, cp_strategies
from annot.memory.engine_memory import RankMemory, _bytes
from annot.memory.quantized_base import (
    QUANTIZED_KEYS,
    QuantizedBase,
    dequantization_in_trace,
    from_pretrained_call,
    priced_base,
)
from annot.memory.report import (
    MARGIN,
    RESERVE,
    _seconds,
    _states,
    _trace_setting,
    step_time,
    strategy_memory,
)
from annot.memory.representative import block_stack, cut_model, fast_trace_step
from annot.memory.solver import solve
from annot.memory.strategies import PRECISIONS, STRATEGIES, MemoryInputError, Strategy, strategy
from annot.policies import Action, Plan, Policy, Rule, make_plan
from annot.policies.plan import format_bytes
from annot.runtime.activation_checkpoint import torch_checkpoint
from annot.runtime.autograd_state import under_outer_checkpoint
from annot.runtime.selective_checkpoint import apply_plan_checkpointing

__all__ = ["BudgetAnswer", "BudgetError", "StrategyFit", "budget_solver", "fit_budget"]

#: Which choices each engine runs (`annot.engines`): FSDP1 offloads no activations,
#: DeepSpeed's checkpoint is reentrant (no selective contexts) and offloads its own way.
ENGINE_CHOICES: dict[str, frozenset[str]] = {
    "ddp": frozenset(CHOICES), "fsdp2": frozenset(CHOICES),
    "fsdp1": frozenset({"none", "selective", "checkpoint"}),
    "deepspeed": frozenset({"none", "checkpoint"}),
}
#: How often the answer is traced again with a tighter budget before the strategy is
#: given up (`BudgetSolver.fit`).
RETRACES = 3


#: One traced answer (`BudgetSolver._found`): predicted step, strategy order, strategy,
#: choice per block, traced device peak (counted bytes).
_Found = tuple[float, int, Strategy, dict[str, str], int]


class BudgetError(MemoryInputError):
    """Nothing fits the budget; ``smallest`` is the least budget that would (bytes), with
    the strategy that needs it."""

    def __init__(self, message: str, smallest: int | None, strategy: str | None) -> None:
        super().__init__(message)
        self.smallest = smallest
        self.strategy = strategy


@dataclasses.dataclass(frozen=True)
class StrategyFit:
    """One strategy under the budget: whether it fits, its per-GPU peak (traced for the
    strategies `BudgetSolver.fit` traced, else the per-block model's; where it does not
    fit, with every block at its least memory), its predicted step (``None`` when it
    does not fit), and the terms at its peak (for `annot.memory.plot`): model states and
    buffers by name plus ``"activations"``."""

    key: str
    label: str
    fits: bool
    peak_bytes: int | None
    step_time_s: float | None
    parts: dict[str, int]


@dataclasses.dataclass(frozen=True)
class BudgetAnswer:
    """The fastest plan within ``budget_bytes`` per GPU: build it with
    ``annot.auto_wrap(model, answer.engine, answer.plan, **answer.options)`` (``call``)."""

    budget_bytes: int
    strategy: str
    label: str
    engine: str
    options: dict[str, Any]
    plan: Plan
    blocks: dict[str, str]
    peak_bytes: int
    step_time_s: float
    #: Predicted step of the same strategy with every block fully checkpointed
    #: (``None`` where that does not fit either).
    checkpoint_all_step_s: float | None
    call: str
    margin: float
    reserve: int
    device: str
    strategies: tuple[StrategyFit, ...] = ()

    @property
    def recomputed(self) -> int:
        """Blocks recomputed in backward (selective, checkpoint, checkpoint_offload)."""
        return sum(c in ("selective", "checkpoint", "checkpoint_offload") for c in self.blocks.values())

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["plan"] = self.plan.to_dict()
        out["strategies"] = [dataclasses.asdict(s) for s in self.strategies]
        out["recomputed"] = self.recomputed
        return out

    def table(self) -> str:
        counts = {c: sum(v == c for v in self.blocks.values()) for c in CHOICES}
        lines = [
            f"budget {format_bytes(self.budget_bytes)} per GPU (counted peak x {1 + self.margin:g} "
            f"+ {format_bytes(self.reserve)} must fit): {self.label}, peak {format_bytes(self.peak_bytes)} "
            f"counted, step {_seconds(self.step_time_s)} predicted on {self.device}",
            "blocks: " + ", ".join(f"{n} {c}" for c, n in counts.items() if n),
        ]
        if self.checkpoint_all_step_s is not None:
            lines.append(f"checkpointing every block instead: step {_seconds(self.checkpoint_all_step_s)}")
        for path, choice in self.blocks.items():
            lines.append(f"  {path}: {choice}")
        lines.append(f"  {self.call}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def fit_budget(model: nn.Module, budget: int, *, gpus: int, nodes: int = 1, batch: int,
               seq: int, precision: str = "bf16-mixed", **options: Any) -> BudgetAnswer:
    """The fastest strategy and per-block activation choices of ``model`` (build it on the
    meta device) whose per-GPU peak fits ``budget`` bytes (`BudgetError`, with the least
    budget that would, otherwise). ``gpus`` per node, ``batch`` the micro-batch per GPU.
    ``options``: those of `budget_solver` (``plan``, ``optimizer``, ``device``,
    ``tflops``, ``hbm_bw``, ``host_bw``, ``margin``, ``reserve``, ``strategies``,
    ``choices``, ``inputs``, ``cp``, ``cp_attention``)."""
    return budget_solver(model, gpus=gpus, nodes=nodes, batch=batch, seq=seq, precision=precision,
                         **options).fit(budget)


def budget_solver(model: nn.Module, *, gpus: int, nodes: int = 1, batch: int, seq: int,
                  precision: str = "bf16-mixed", plan: Plan | Policy | Rule | None = None,
                  optimizer: str = "adamw", device: str = "H100", tflops: float | None = None,
                  hbm_bw: float | None = None, host_bw: float | None = None,
                  intra_node_bw: float = INTRA_NODE_BW, inter_node_bw: float = INTER_NODE_BW,
                  margin: float = MARGIN, reserve: int = RESERVE,
                  strategies: Sequence[str] | None = None, choices: Sequence[str] = CHOICES,
                  inputs: InputsFn | None = None, fast_trace: bool = True, cp: Sequence[int] = (),
                  cp_attention: str = "allgather", quantize: str | None = None,
                  unquantized: Rule | str | None = None) -> BudgetSolver:
    """A `BudgetSolver` for ``model``: the traces are made once, each `BudgetSolver.fit`
    solves one budget. ``device`` names the cost model's figures
    (`annot.memory.choices.DEVICES`), each overridable (TFLOP/s, GB/s); ``strategies``
    the strategy keys weighed (default: every one-dimensional strategy), ``choices`` the
    block choices allowed; ``fast_trace=False`` traces every block instead of a
    representative few (`annot.memory.representative`; the answers are the same, it is
    slower). NVMe strategies are weighed only when named (their speed is
    the drives'); on a device without a host link (``cpu``) no offload is. ``cp``:
    context-parallel sizes weighed besides, each ``FSDP2 + CP c`` (each sequence split
    over ``c`` ranks of a node: traced at ``seq / c``, with the cp group's keys and
    values, collectives and FLOPs, `annot.memory.context_parallel`), with attention split
    as ``cp_attention`` says (``"allgather"`` or ``"ulysses"``). ``quantize="nf4"``
    (with ``unquantized``): the frozen base quantized as ``annot.from_pretrained(...,
    quantize=)`` does it, priced as `annot.estimate_memory` prices it; only the DDP and
    FSDP2 strategies are weighed (the engines annot trains a quantized base on) and the
    answer's call is a ``from_pretrained`` call."""
    if precision not in PRECISIONS:
        raise MemoryInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    unknown = [c for c in choices if c not in CHOICES]
    if unknown or not choices:
        raise MemoryInputError(f"unknown block choice(s) {unknown or choices!r}; choose from {', '.join(CHOICES)}")
    if batch < 1 or seq < 1 or gpus < 1 or nodes < 1:
        raise MemoryInputError("batch, seq, gpus and nodes must be at least 1")
    if not isinstance(plan, Plan):
        plan = make_plan(model, plan)
    dev = device if isinstance(device, Device) else _device(device, tflops, hbm_bw, host_bw)
    if strategies is not None:
        chosen = [strategy(k) for k in strategies]
    else:  # NVMe's speed is the drives'; without a host link nothing is offloaded
        chosen = [s for s in STRATEGIES if s.option("offload") != "nvme"
                  and (dev.host_bw > 0 or (s.offload_optimizer is None and not s.offload_params))]
    if dev.host_bw <= 0 and any(s.offload_optimizer is not None or s.offload_params for s in chosen):
        raise MemoryInputError(f"device {dev.name!r} has no host link (host_bw=0): leave the "
                               "strategies that offload to the host out, or give host_bw=")
    for c in cp:
        if seq % (2 * c):
            raise MemoryInputError(f"cp={c}: seq {seq} is not a multiple of {2 * c} (each sequence "
                                   f"is split into {2 * c} equal chunks)")
    chosen += cp_strategies(tuple(cp), gpus, gpus * nodes, cp_attention)
    base = priced_base(model, quantize, precision, gpus * nodes, unquantized)
    if quantize is not None:
        other = [s.key for s in chosen if s.key not in QUANTIZED_KEYS]
        if cp or (strategies is not None and other):
            raise MemoryInputError(
                f"quantize={quantize!r} trains on DDP and FSDP2: weigh {', '.join(QUANTIZED_KEYS)}, "
                f"not {', '.join(other)}")
        chosen = [s for s in chosen if s.key in QUANTIZED_KEYS]
    network = Network(gpus_per_node=gpus, nodes=nodes, intra_node_bw=intra_node_bw * 1e9,
                      inter_node_bw=inter_node_bw * 1e9, flops=dev.tflops * 1e12,
                      float8_speedup=dev.float8_speedup)
    return BudgetSolver(model=model, plan=plan, strategies=tuple(chosen), network=network, dev=dev,
                        batch=batch, seq=seq, precision=precision, optimizer=optimizer,
                        margin=margin, reserve=reserve, choices=tuple(choices), inputs=inputs,
                        fast_trace=fast_trace, attention=attention_shape(model) if cp else None,
                        quantized=base)


def _device(name: str, tflops: float | None, hbm_bw: float | None, host_bw: float | None) -> Device:
    return device(name, tflops=tflops, hbm_bw=hbm_bw, host_bw=host_bw)


def block_paths(plan: Plan) -> list[str]:
    """The blocks choices are made for: the Plan's checkpointed units, else its shard
    units; units of one module each (a tied group is left as the Plan has it)."""
    units = [u for u in plan.units if u.has(Action.CHECKPOINT)] or [u for u in plan.units if u.has(Action.SHARD)]
    return [u.path for u in units if not u.group and u.path]


@dataclasses.dataclass
class _Setting:
    """What one trace setting (parameter dtype, autocast) gives every strategy using it."""

    blocks: list[BlockProfile]
    trace: StepTrace


@dataclasses.dataclass(frozen=True)
class _Points:
    """One strategy's memory model (`BudgetSolver.points`): the device bytes with no
    activation at all (``bare``); per block, the most the device holds while the block
    runs beyond the bytes blocks up to it hold (``extra``: backward's transients, what
    lives outside every block, the engine's memory at that moment); the same outside
    every block beyond all blocks' held bytes (``head``)."""

    bare: int
    extra: list[float]
    head: float


@dataclasses.dataclass
class BudgetSolver:
    """The traces of one model and setup; `fit` answers one budget (see the module
    docstring). Build it with `budget_solver`."""

    model: nn.Module
    plan: Plan
    strategies: tuple[Strategy, ...]
    network: Network
    dev: Device
    batch: int
    seq: int
    precision: str
    optimizer: str
    margin: float
    reserve: int
    choices: tuple[str, ...]
    inputs: InputsFn | None = None
    #: Trace a representative few blocks of the longest stack of identical blocks and
    #: grow them (`annot.memory.representative`): the plain step, the block profiles,
    #: and the answers (one choice for every block: cut to 2 and 3 blocks; mixed
    #: choices: each run of one choice cut to at most 5 blocks, traced whole where the
    #: cut cannot stand for the rest).
    fast_trace: bool = True
    #: The attention's shape, for context-parallel strategies (``None``: none weighed).
    attention: AttentionShape | None = None
    #: A frozen base quantized on load (QLoRA): its stored bytes and its dequantization
    #: transients, traced where they happen (`annot.memory.quantized_base`).
    quantized: QuantizedBase | None = None

    def __post_init__(self) -> None:
        self.paths = block_paths(self.plan)
        if not self.paths:
            raise MemoryInputError(
                f"the Plan of {self.plan.model} has no block to choose for (no checkpointed or "
                "sharded unit): pass plan= (a policy selecting the repeated blocks)")
        self.facts, self.records = _states(self.model, self.plan, self.quantized)
        self.buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        self._settings: dict[tuple[Any, ...], _Setting] = {}
        self._traces: dict[tuple[Any, ...], StepTrace] = {}
        self._points: dict[str, _Points] = {}
        #: Every answer traced so far (`fit`): (step, strategy order, strategy, choices,
        #: traced device peak) by strategy key and choices.
        self._found: dict[tuple[str, tuple[tuple[str, str], ...]], _Found] = {}

    # -- traces --------------------------------------------------------------------------
    def seq_of(self, s: Strategy) -> int:
        """The tokens of a sequence one rank of ``s`` holds (``seq / cp`` under context
        parallelism)."""
        return self.seq // dict(s.mesh).get("cp", 1)

    def setting(self, s: Strategy) -> _Setting:
        dtype, autocast = _trace_setting(s, self.precision)
        seq = self.seq_of(s)
        # FSDP2's float8-gathered weights are not cast at each matmul (as estimate_memory).
        float8_gathered = self.facts.gathers_float8(s.engine)
        key = (dtype, autocast, seq, float8_gathered)
        if key not in self._settings:
            blocks = self._profiles(dtype, autocast, seq)
            trace = (fast_trace_step if self.fast_trace else trace_step)(
                self.model, self.plan, batch=self.batch, seq=seq, checkpoint=False,
                dtype=dtype, autocast=autocast, inputs=self.inputs, float8_gathered=float8_gathered)
            self._settings[key] = _Setting(blocks, trace)
        return self._settings[key]

    def _profiles(self, dtype: torch.dtype | None, autocast: torch.dtype | None,
                  seq: int) -> list[BlockProfile]:
        """`profile_blocks` of every block. With `fast_trace` and a `block_stack`, the
        model cut to 3 blocks is profiled instead: block 0 stands for itself, block 1
        for every middle block, block 2 for the last (the first block's input and the
        last block's output meet other modules; the middle ones are alike), other
        units for themselves. A model whose forward needs all its blocks is profiled
        whole."""
        kwargs: dict[str, Any] = dict(batch=self.batch, seq=seq, dtype=dtype, autocast=autocast,
                                      inputs=self.inputs)
        stack = block_stack(self.model, self.plan) if self.fast_trace else None
        if stack is None:
            return profile_blocks(self.model, self.paths, **kwargs)[0]
        cut = 3
        source = {stack.path(i): stack.path(i if i < cut - 1 else 1 if i < stack.count - 1 else cut - 1)
                  for i in range(stack.count)}
        kept = [source.get(p, p) for p in self.paths]
        try:
            with cut_model(self.model, self.plan, stack, cut):
                found, _ = profile_blocks(self.model, list(dict.fromkeys(kept)), **kwargs)
        except Exception:  # the model needs all its blocks: profile it whole
            return profile_blocks(self.model, self.paths, **kwargs)[0]
        by_path = {b.path: b for b in found}
        return [dataclasses.replace(by_path[k], path=p) for p, k in zip(self.paths, kept, strict=True)]

    def points(self, s: Strategy) -> _Points:
        """`_Points` of ``s``, from the plain step's trace: each stretch of it (top and
        end, `StepTrace.segments`) with the engine memory `strategy_memory` adds there.
        With every block at ``none`` this model gives the traced peak exactly."""
        if s.key in self._points:
            return self._points[s.key]
        st = self.setting(s)
        trace, big = st.trace, 1 << 50
        shard = {p: i for i, u in enumerate(u for u in self.plan.units if u.has(Action.SHARD))
                 for p in u.modules}
        block_of = {shard[b.path]: i for i, b in enumerate(st.blocks) if b.path in shard}
        prefix = [0] * len(st.blocks)
        running = 0
        for i, b in enumerate(st.blocks):
            running += b.keep
            prefix[i] = running
        extra: list[float] = [-float("inf")] * len(st.blocks)
        head = -float("inf")
        engine = self._engine_at(s, trace, big)
        for (_, unit, top, end), held_here in zip(trace.segments, engine, strict=True):
            for act, engine_bytes in zip((top, end), held_here, strict=True):
                if engine_bytes is None:
                    continue  # the engine has no stretch at this point
                value = act + engine_bytes
                if unit in block_of:
                    i = block_of[unit]
                    extra[i] = max(extra[i], value - prefix[i])
                else:
                    head = max(head, value - running)
        if not trace.segments:  # no stretches: one point at the trace's peak
            head = trace.peak + self._flat_memory(s, big).device - big - running
        if any(e == -float("inf") for e in extra):  # a block that is no shard unit
            worst = max((e + prefix[i] for i, e in enumerate(extra) if e != -float("inf")),
                        default=head + running)
            extra = [e if e != -float("inf") else max(worst, head + running) - prefix[i]
                     for i, e in enumerate(extra)]
        self._points[s.key] = _Points(self._flat_memory(s, 0).device, extra, head)
        return self._points[s.key]

    def _engine_at(self, s: Strategy, trace: StepTrace, big: int) -> list[tuple[int | None, int | None]]:
        """The engine's device memory (all but the activations, with every term added
        after the peak) while each segment of ``trace`` is at its top and at its end;
        ``None`` where the engine has no stretch there. By definition: `_memory` of
        ``trace`` with that one activation set to ``big`` and the others to 0, minus
        ``big`` (the whole step's peak is ``big`` too, for engines that price only it).
        Read here from one `_memory` call instead of two per segment: each segment's top
        and end replaced by a tag of its own (``2k + 1`` and ``2k + 2`` times ``big``),
        the whole step's peak by ``2S + 1`` times it; every point of the peak then says
        by its activations which tag it holds, and what it holds beside (below ``big``:
        gradients added to a peak) counts as the engine's."""
        n = len(trace.segments)
        tagged = dataclasses.replace(
            trace, peak=(2 * n + 1) * big, peak_with_grads=(2 * n + 1) * big + trace.grads,
            segments=tuple((ph, u, (2 * k + 1) * big, (2 * k + 2) * big)
                           for k, (ph, u, _, _) in enumerate(trace.segments)))
        points: list[tuple[int, int]] = []
        memory = self._memory(s, tagged, points)
        added = memory.device - max(at for at, _ in points)
        engine_at: dict[int, int] = {}
        for at, activations in points:
            tag = activations // big
            if tag:
                engine_at[tag] = max(engine_at.get(tag, 0), at - tag * big + added)
        everywhere = engine_at.get(2 * n + 1)  # points that price the whole step's peak

        def at_tag(tag: int) -> int | None:
            found = [e for e in (engine_at.get(tag), everywhere) if e is not None]
            return max(found) if found else None

        return [(at_tag(2 * k + 1), at_tag(2 * k + 2)) for k in range(n)]

    def _memory(self, s: Strategy, trace: StepTrace,
                points: list[tuple[int, int]] | None = None) -> RankMemory:
        """`strategy_memory` of ``s`` on ``trace``, plus the model's buffers: every rank
        keeps them whole, and no term of `annot.memory.engine_memory` counts them (the
        example GPT's causal masks: 512 KiB at block size 256 x 8 blocks, what a counted
        2-rank run measured above the plain planner's figure)."""
        memory = strategy_memory(s, trace, self.facts, self.plan, world=self.network.world,
                                 precision=self.precision, optimizer=self.optimizer, records=self.records,
                                 attention=self.attention, points=points)
        if not self.buffers:
            return memory
        return dataclasses.replace(memory, device=memory.device + self.buffers,
                                   combined=memory.combined + self.buffers,
                                   parts={**memory.parts, "buffers": self.buffers})

    def _allowed(self, s: Strategy) -> list[str]:
        allowed = [c for c in self.choices if c in ENGINE_CHOICES[s.engine]]
        if self.dev.host_bw <= 0:
            allowed = [c for c in allowed if c not in OFFLOAD_CHOICES]
        return allowed

    # -- solving -------------------------------------------------------------------------
    def _solve(self, s: Strategy, limit: float) -> tuple[float, list[str]] | None:
        """(added seconds, choice per block) of ``s`` whose modelled device peak is at
        most ``limit`` counted bytes, or ``None``."""
        st, pts = self.setting(s), self.points(s)
        if pts.bare > limit:
            return None
        allowed = self._allowed(s)
        held_ = [[float(held(b, c)) for c in allowed] for b in st.blocks]
        cost = [[choice_seconds(b, c, self.dev) for c in allowed] for b in st.blocks]
        limits = [limit - b.keep - e for b, e in zip(st.blocks, pts.extra, strict=True)]
        found = solve(held_, cost, limits, limit - pts.head)
        if found is None:
            return None
        return found[0], [allowed[i] for i in found[1]]

    def _counted(self, budget: int) -> float:
        """Counted bytes a budget leaves: budget = counted x (1 + margin) + reserve."""
        return (budget - self.reserve) / (1 + self.margin)

    def plan_for(self, blocks: dict[str, str]) -> Plan:
        """The Plan with ``blocks``' choices (`annot.policies.plan.Unit` fields); offload
        marks are dropped (the strategy's options say what is offloaded)."""
        units = []
        for u in self.plan.units:
            actions: tuple[Action, ...] = tuple(a for a in u.actions
                                                if a not in (Action.CHECKPOINT, Action.OFFLOAD))
            choice = blocks.get(u.path)
            if choice is None:
                units.append(dataclasses.replace(u, actions=actions))
                continue
            if choice in ("selective", "checkpoint", "checkpoint_offload"):
                actions = (*actions, Action.CHECKPOINT)
            units.append(dataclasses.replace(
                u, actions=actions, offload_to=None,
                checkpoint_policy="save_matmuls" if choice == "selective" else None,
                offload_activations=choice in OFFLOAD_CHOICES,
                reason=f"{u.reason}; budget: {choice}"))
        return dataclasses.replace(self.plan, units=tuple(units), policy=f"{self.plan.policy} + budget")

    def trace_plan(self, s: Strategy, plan: Plan) -> StepTrace:
        """The training step of ``plan`` traced as it runs (`trace_step`; with
        `fast_trace`, `fast_trace_step`), activation offload as memory leaving the
        device."""
        dtype, autocast = _trace_setting(s, self.precision)
        checkpointed = plan.paths(Action.CHECKPOINT)
        offloaded = [u.path for u in plan.units if u.offload_activations]

        def prepare(copy: nn.Module) -> None:
            # A cut copy (`fast_trace_step`) lacks the blocks cut away; what each kept
            # block gets follows from its own unit, as `fast_trace_step` requires.
            apply_plan_checkpointing(copy, plan, [p for p in checkpointed if _has(copy, p)], torch_checkpoint)
            for path in offloaded:
                if _has(copy, path):
                    _traced_offload(copy.get_submodule(path))

        # Blocks with different choices are traced from a cut model too (`fast_trace_step`
        # lays out each block's increments; it traces whole where they do not repeat).
        trace = fast_trace_step if self.fast_trace else trace_step
        return trace(self.model, plan, batch=self.batch, seq=self.seq_of(s),
                     checkpoint=bool(checkpointed),
                     dtype=dtype, autocast=autocast, inputs=self.inputs, prepare=prepare)

    def _base_step(self, s: Strategy) -> float:
        """The predicted step of ``s`` with no block recomputed or offloaded: compute and
        collectives overlapped (`step_time`), plus its host transfers (`_host_seconds`)."""
        return step_time(s, self.setting(s).trace, self.plan, self.model, self.records, self.network,
                         precision=self.precision, optimizer=self.optimizer,
                         attention=self.attention).overlapped + self._host_seconds(s)

    def _host_seconds(self, s: Strategy) -> float:
        """Seconds a strategy that keeps states on the host moves them over the host link
        each step, not overlapped: with parameters on the host, this rank's parameter
        shard comes to the device for each gather (forward, and backward when
        resharded) and its gradient shard goes back; with the optimizer alone there, the
        gradient shard goes and the updated parameter shard comes back. The host
        optimizer's own compute is not priced."""
        if s.offload_optimizer is None and not s.offload_params:
            return 0.0
        b = _bytes(self.precision, s.engine, self.optimizer)
        shard = -(-self.facts.params // self.network.world)
        if s.offload_params:
            moved = shard * b["param"] * (2 if s.stage == 3 else 1) + shard * b["reduce"]
        else:
            moved = shard * (b["grad"] + b["compute"])
        return moved / (self.dev.host_bw * GB)

    def _model_peak(self, s: Strategy, blocks: dict[str, str]) -> int:
        """The per-block model's device peak of ``blocks`` (`points`)."""
        st, pts = self.setting(s), self.points(s)
        held_before, peak = 0.0, float(pts.bare)
        for b, extra in zip(st.blocks, pts.extra, strict=True):
            peak = max(peak, held_before + b.keep + extra)
            held_before += held(b, blocks[b.path])
        return int(max(peak, held_before + pts.head))

    def _flat_memory(self, s: Strategy, activations: int) -> RankMemory:
        trace = self.setting(s).trace
        return self._memory(s, dataclasses.replace(
            trace, peak=activations, peak_with_grads=activations + trace.grads,
            segments=tuple((ph, u, activations, activations) for ph, u, _, _ in trace.segments)))

    def _verified(self, s: Strategy, budget: int, limit: float,
                  ) -> tuple[float, dict[str, str], RankMemory] | None:
        """(added seconds, choices, traced memory) of ``s``: solved, traced as it runs,
        solved again with the model's shortfall taken off the limit while the trace
        exceeds the budget (at most `RETRACES` times)."""
        counted = self._counted(budget)
        for _ in range(RETRACES):
            found = self._solve(s, limit)
            if found is None:
                return None
            added, picks = found
            blocks = dict(zip(self.paths, picks, strict=True))
            memory = self._memory(s, self._traced(s, blocks))
            if memory.device <= counted:
                return added, blocks, memory
            limit -= memory.device - counted  # the per-block model was short by this much
        return None

    def _traced(self, s: Strategy, blocks: dict[str, str]) -> StepTrace:
        """`trace_plan` of ``blocks``, once per trace setting and choices."""
        key = (*_trace_setting(s, self.precision), self.seq_of(s), tuple(blocks.items()))
        if key not in self._traces:
            self._traces[key] = self.trace_plan(s, self.plan_for(blocks))
        return self._traces[key]

    def fit(self, budget: int) -> BudgetAnswer:
        """The fastest answer within ``budget`` bytes per GPU (`BudgetError` if none).
        Every strategy is solved on the per-block model; the fastest are traced as they
        run, in order, until none left could beat the fastest traced one."""
        # Every trace (made lazily, here or in smallest_budget) sees a quantized base's
        # dequantization transients: the hooks travel with the copies the traces make.
        with dequantization_in_trace(self.model, self.quantized):
            return self._fit(budget)

    def _fit(self, budget: int) -> BudgetAnswer:
        if budget <= 0:
            raise MemoryInputError(f"the budget must be a positive number of bytes, got {budget}")
        modelled: list[tuple[float, int, Strategy, float, dict[str, str]]] = []
        fits: dict[str, StrategyFit] = {}
        limit = self._counted(budget)
        for order, s in enumerate(self.strategies):
            found = self._solve(s, limit)
            if found is None:
                least = {b.path: _least(b, self._allowed(s)) for b in self.setting(s).blocks}
                memory = self._modelled_memory(s, least)
                fits[s.key] = StrategyFit(s.key, s.label, False, memory.device, None, _parts(memory))
                continue
            blocks = dict(zip(self.paths, found[1], strict=True))
            memory = self._modelled_memory(s, blocks)
            step = self._base_step(s) + found[0]
            fits[s.key] = StrategyFit(s.key, s.label, True, memory.device, step, _parts(memory))
            modelled.append((step, order, s, limit, blocks))
        counted = self._counted(budget)
        best = self._best_found(counted)
        for step, order, s, limit, _ in sorted(modelled, key=lambda m: (m[0], m[1])):
            if best is not None and step >= best[0] * (1 - 1e-9):
                break  # tracing only ever lowers the limit, so it cannot get faster
            verified = self._verified(s, budget, limit)
            if verified is None:
                fits[s.key] = dataclasses.replace(fits[s.key], fits=False, step_time_s=None)
                continue
            added, blocks, memory = verified
            traced_step = self._base_step(s) + added
            fits[s.key] = StrategyFit(s.key, s.label, True, memory.device, traced_step, _parts(memory))
            self._found[(s.key, tuple(blocks.items()))] = (traced_step, order, s, blocks, memory.device)
            best = self._best_found(counted)
        if best is not None and fits[best[2].key].step_time_s != best[0]:
            # An answer traced for another budget beats what this budget's own solve gave.
            s = best[2]
            memory = self._memory(s, self._traced(s, best[3]))
            fits[s.key] = StrategyFit(s.key, s.label, True, memory.device, best[0], _parts(memory))
        if best is None:
            smallest, key = self._smallest_budget()
            raise BudgetError(
                f"nothing fits {format_bytes(budget)} per GPU: the smallest budget that would is "
                f"{format_bytes(smallest)} ({self._label(key)}, every block at its least memory)"
                if smallest is not None and key is not None else
                f"nothing fits {format_bytes(budget)} per GPU with these strategies and choices",
                smallest, key)
        step, _, s, blocks, peak = best
        return BudgetAnswer(
            budget_bytes=budget, strategy=s.key, label=s.label, engine=s.engine,
            options=s.engine_options(self.precision), plan=self.plan_for(blocks), blocks=blocks,
            peak_bytes=peak, step_time_s=step, checkpoint_all_step_s=self._checkpoint_all(s, budget),
            call=(_call(s, self.precision) if self.quantized is None
                  else from_pretrained_call(s, self.quantized.format, self.precision, None, plan=True)),
            margin=self.margin, reserve=self.reserve,
            device=self.dev.name, strategies=tuple(fits[x.key] for x in self.strategies))

    def _best_found(self, counted: float) -> _Found | None:
        """The fastest answer traced so far whose traced peak is within ``counted`` bytes
        (ties: the earlier strategy in `strategies`, then the answer found first)."""
        fitting = [f for f in self._found.values() if f[4] <= counted]
        return min(fitting, key=lambda f: (f[0], f[1]), default=None)

    def _label(self, key: str) -> str:
        return next(s.label for s in self.strategies if s.key == key)

    def _modelled_memory(self, s: Strategy, blocks: dict[str, str]) -> RankMemory:
        """``s``'s memory with the activations the per-block model gives ``blocks`` at
        its peak (terms for the picture of strategies not traced)."""
        big = 1 << 50
        beside = self._flat_memory(s, big).device - big
        return self._flat_memory(s, max(0, self._model_peak(s, blocks) - beside))

    def _checkpoint_all(self, s: Strategy, budget: int) -> float | None:
        """The predicted step of ``s`` with every block fully checkpointed, if it fits."""
        memory = self._memory(s, self._traced(s, dict.fromkeys(self.paths, "checkpoint")))
        if memory.device > self._counted(budget):
            return None
        return self._base_step(s) + sum(choice_seconds(b, "checkpoint", self.dev)
                                        for b in self.setting(s).blocks)

    def smallest_budget(self) -> tuple[int | None, str | None]:
        """The least budget some strategy fits and that strategy's key: the per-block
        model's least over strategies, raised to what the trace of that strategy with
        every block at its least memory needs (the model can be short; the trace is what
        runs)."""
        with dequantization_in_trace(self.model, self.quantized):
            return self._smallest_budget()

    def _smallest_budget(self) -> tuple[int | None, str | None]:
        best: tuple[int, Strategy] | None = None
        for s in self.strategies:
            lo, hi = 0.0, float(1 << 50)
            if self._solve(s, hi) is None:
                continue
            while hi - lo > max(1.0, hi * 1e-6):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if self._solve(s, mid) is not None else (mid, hi)
            need = int(hi * (1 + self.margin) + self.reserve) + 1
            if best is None or need < best[0]:
                best = (need, s)
        if best is None:
            return None, None
        need, s = best
        least = {b.path: _least(b, self._allowed(s)) for b in self.setting(s).blocks}
        traced = self._memory(s, self._traced(s, least)).device
        return max(need, int(traced * (1 + self.margin) + self.reserve) + 1), s.key


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _least(block: BlockProfile, allowed: list[str]) -> str:
    """The allowed choice holding the fewest bytes for ``block``."""
    return min(allowed, key=lambda c: held(block, c))


def _parts(memory: RankMemory) -> dict[str, int]:
    return {k: v for k, v in memory.parts.items() if not k.startswith("host: ")}


def _call(s: Strategy, precision: str) -> str:
    """The ``auto_wrap`` call of ``s`` taking the answer's Plan (``plan``)."""
    return s.call(precision).replace(f'annot.auto_wrap(model, "{s.engine}"',
                                     f'annot.auto_wrap(model, "{s.engine}", plan', 1)


def _traced_offload(module: nn.Module) -> None:
    """Activation offload as the trace sees it: what the module's forward saves leaves
    the device (kept as a shape, no storage) and is allocated again when backward reads
    it; pushed under the same conditions as `annot.runtime.activation_offload`'s hooks."""
    stack: list[Any] = []

    def pack(t: torch.Tensor) -> Any:
        if type(t) is not torch.Tensor or t.layout != torch.strided or isinstance(t._base, nn.Parameter):
            return t
        return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, dtype, where = packed
        return torch.empty_strided(shape, stride, dtype=dtype, device=where)

    def enter(mod: nn.Module, args: Any) -> None:
        hooks = None
        if torch.is_grad_enabled() and not under_outer_checkpoint():
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            hooks.__enter__()
        stack.append(hooks)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        hooks = stack.pop() if stack else None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)

