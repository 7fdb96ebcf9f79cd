"""Per-rank memory of one strategy: model states as each engine stores them, the
engine's own buffers (read from the config annot writes), the parameters it gathers
while a unit runs, and the traced activations (docs/design.md, pitfall 16).

Everything is in bytes per rank, ``device`` (the GPU) and ``host`` (offloaded states).
The peak is the largest of the forward/backward stretches of the trace (activations
there plus what the engine holds while that unit runs) and the optimizer step (states,
gradients, the step's temporaries). How each engine was read (torch 2.13, DeepSpeed
0.19) is stated at each term; tests/memory/test_counted.py checks the sums against
counted 2-rank CPU runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from annot.engines.deepspeed_config import PERSISTENCE_THRESHOLD
from annot.memory.activations import StepTrace
from annot.memory.quantized_base import QuantizedCosts
from annot.memory.strategies import MemoryInputError, Strategy
from annot.memory.user_config import ZERO_DEFAULTS

__all__ = ["OPTIMIZERS", "ModelFacts", "RankMemory", "rank_memory"]

#: Optimizer state tensors per parameter, and whether its step makes a temporary of
#: the states' size (torch's foreach Adam/AdamW, the GPU default: ``sqrt(exp_avg_sq)``).
#: ``adamw-for-loop``/``adam-for-loop``: ``foreach=False`` (torch's default before 2.0),
#: or DeepSpeed's FusedAdam and CPUAdam, which step in place: no states-sized temporary.
OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "adamw": (2, True), "adam": (2, True), "adamw-for-loop": (2, False), "adam-for-loop": (2, False),
    "sgd-momentum": (1, False), "sgd": (0, False),
}


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the engines' memory depends on besides the trace: parameter counts (each
    shared parameter once), the largest module's own parameters, and how many
    parameters DeepSpeed ZeRO-3 keeps whole (at most its persistence threshold). The
    ``trainable`` counts (``None``: every parameter trains) are what gradients, fp32
    master copies and optimizer states are kept for: a frozen vision tower or a LoRA
    base has none of them (no engine gives a frozen parameter a gradient or a state)."""

    params: int
    units: tuple[int, ...]
    root: int
    persistent: int
    trainable: int | None = None
    unit_trainable: tuple[int, ...] | None = None
    root_trainable: int | None = None
    #: A quantized frozen base (QLoRA): how many weights are quantized, in each unit and
    #: outside the units, and what each holds (`annot.memory.quantized_base`; the
    #: transient of dequantizing one is in the traced step, where it happens).
    unit_quantized: tuple[int, ...] | None = None
    root_quantized: int = 0
    quantized_costs: QuantizedCosts | None = None
    #: Float8 all-gather (FSDP2, tensorwise float8 units): how many weights of each unit
    #: and of the root FSDP2 gathers in float8, one byte each (`annot.float8`).
    unit_float8: tuple[int, ...] | None = None
    root_float8: int = 0

    def gathers_float8(self, engine: str) -> bool:
        """Whether ``engine`` gathers some weight in float8: FSDP2 alone does (one byte a
        weight; its trace casts none, the gathered weight is float8 already,
        `annot.float8.as_gathered_in_float8`)."""
        return engine == "fsdp2" and bool(sum(self.unit_float8 or ()) + self.root_float8)

    def unit_float8_count(self, index: int) -> int:
        """Unit ``index``'s weights gathered in float8 (0 outside the units)."""
        if self.unit_float8 is None or not 0 <= index < len(self.unit_float8):
            return 0
        return self.unit_float8[index]

    @property
    def quantized(self) -> int:
        return sum(self.unit_quantized or ()) + self.root_quantized

    def unit_quantized_count(self, index: int) -> int:
        """Unit ``index``'s quantized weights (0 outside the units)."""
        if self.unit_quantized is None or not 0 <= index < len(self.unit_quantized):
            return 0
        return self.unit_quantized[index]

    def stored(self, params: int, quantized: int, per_param: int) -> int:
        """The bytes of ``params`` parameters of which ``quantized`` are quantized, the
        others ``per_param`` bytes each."""
        if not quantized or self.quantized_costs is None:
            return params * per_param
        return (params - quantized) * per_param + round(quantized * self.quantized_costs.stored)

    @property
    def largest_unit(self) -> int:
        return max((*self.units, self.root, 1))

    @property
    def trained(self) -> int:
        """The parameters that get gradients and optimizer states."""
        return self.params if self.trainable is None else self.trainable

    def unit_trained(self, index: int) -> int:
        """Unit ``index``'s parameters that get gradients (0 outside the units)."""
        if not 0 <= index < len(self.units):
            return 0
        return self.units[index] if self.unit_trainable is None else self.unit_trainable[index]

    @property
    def root_trained(self) -> int:
        return self.root if self.root_trainable is None else self.root_trainable


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One rank's device peak (``device``, in ``phase``), the host's (``host``), the
    peak of both added (``combined``: what a CPU-only run counts), and the terms behind
    the device peak (``parts``: name -> bytes; host terms start with ``"host: "``)."""

    device: int
    host: int
    phase: str
    parts: dict[str, int]
    combined: int


def _bytes(precision: str, engine: str, optimizer: str) -> dict[str, int]:
    """Bytes per parameter: ``param`` as stored, ``compute`` as gathered/used, ``grad``
    as produced, ``master`` fp32 copy, ``state`` per optimizer tensor, ``reduce``
    reduce-scatter dtype (FSDP)."""
    if optimizer not in OPTIMIZERS:
        raise MemoryInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    sixteen = precision in ("bf16-mixed", "fp16-mixed")
    if precision == "bf16" and engine != "deepspeed":
        return dict(param=2, compute=2, grad=2, master=0, state=2, reduce=2)
    if engine == "deepspeed":
        # DeepSpeed keeps an fp32 partition for the optimizer in every mode (measured:
        # also with fp32 parameters); 16-bit modes store 16-bit parameters and gradients.
        b = 2 if sixteen or precision == "bf16" else 4
        return dict(param=b, compute=b, grad=b, master=4, state=4, reduce=b)
    if sixteen and engine in ("fsdp2", "fsdp1"):
        # MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32): fp32 shards,
        # 16-bit gathered parameters and unsharded gradients, fp32 reduce-scatter.
        return dict(param=4, compute=2, grad=2, master=0, state=4, reduce=4)
    return dict(param=4, compute=4, grad=4, master=0, state=4, reduce=4)  # fp32, amp, DDP


Parts = dict[str, int]
HOST = "host: "  # parts whose name starts so live in host memory


def rank_memory(strategy: Strategy, trace: StepTrace, facts: ModelFacts, *, world: int,
                precision: str, optimizer: str, ds_zero: dict[str, Any] | None = None,
                ddp_bucket_view: bool = True, points: list[tuple[int, int]] | None = None) -> RankMemory:
    """The per-rank memory of ``strategy`` on ``world`` ranks (see the module docstring).
    ``ds_zero`` is the ``zero_optimization`` section DeepSpeed runs with (absent keys:
    DeepSpeed's defaults). ``points``, when given, receives (device bytes, activation
    bytes) of every point the peak is taken over: where the budget solver reads the
    engine's memory at each stretch of the step from one call (`annot.memory.budget`)."""
    b = _bytes(precision, strategy.engine, optimizer)
    n_states, foreach_temp = OPTIMIZERS[optimizer]
    P, n = facts.params, world
    T = facts.trained  # what has gradients, master copies and optimizer states
    shard = -(-P // n)
    trained_shard = -(-T // n)
    states = n_states * b["state"]
    temp = b["state"] if foreach_temp else 0
    segments = trace.segments or (("forward", -1, trace.peak, trace.peak),)
    units = facts.units

    def unit(i: int) -> int:
        return units[i] if 0 <= i < len(units) else 0

    def name(ph: str, u: int) -> str:
        return f"{ph} {'outside units' if u < 0 else f'unit {u}'}"

    if strategy.engine == "ddp":
        # Parameters, gradients living in DDP's buckets (views with
        # gradient_as_bucket_view, else a second copy beside .grad), optimizer states.
        # A quantized base (QLoRA) is held whole in its packed bytes on every rank.
        static = {"params": facts.stored(P, facts.quantized, b["param"]), "grad buckets": T * b["grad"],
                  "optimizer": T * states}
        act = trace.peak if ddp_bucket_view else trace.peak_with_grads
        step = {"optimizer step temporaries": T * temp}
        return _peak(static, [("forward/backward", {"activations": act})], step, points)

    if strategy.engine == "deepspeed":
        zero = _ds_defaults(ds_zero or {})
        stage = int(zero["stage"])
        bucket = int(zero["reduce_bucket_size"]) * b["grad"] * (2 if zero["overlap_comm"] and stage < 3 else 1)
        off = HOST if strategy.offload_optimizer is not None else ""
        # The fp32 partition and the optimizer states of this rank's part (on the host
        # with offload, beside an fp32 gradient partition there).
        static = {f"{off}fp32 partition + optimizer": trained_shard * (b["master"] + states),
                  "reduce bucket": bucket}
        if off:
            static[f"{HOST}fp32 gradient partition"] = trained_shard * 4
        # The gradient partition is allocated at the first bucket reduce, once backward
        # has produced a bucket's worth (one unit, as annot sizes the bucket; measured),
        # so not while the activations peak at backward's start; stage 1 on DeepSpeed
        # 0.19 partitions gradients as stage 2 does.
        grads = {"gradient partition": trained_shard * b["grad"]}
        step = {**grads, "optimizer step temporaries": 0 if off else trained_shard * temp}
        if b["grad"] != 4 and not off:
            step["fp32 gradient partition"] = trained_shard * 4
        if stage in (1, 2):
            # Flat parameters whole on every rank; the reduce bucket (twice with
            # overlap_comm).
            static["params"] = P * b["param"]
            stretches: list[tuple[str, Parts]] = []
            allocated = bool(off)  # with offload: allocated with the host buffers (measured)
            for ph, u, top, end in segments:
                if ph == "backward" and u >= 0 and not allocated:
                    # The first unit's gradients overflow the bucket as that unit ends.
                    stretches += [(name(ph, u), {"activations": top}),
                                  (name(ph, u) + " end", {"activations": end, **grads})]
                    allocated = True
                else:
                    stretches.append((name(ph, u), {"activations": top, **(grads if allocated else {})}))
            return _peak(static, stretches, step, points)
        # ZeRO-3: the parameter partition (host with parameter offload), persistent
        # parameters whole; while a unit runs, it and the prefetch bucket are gathered.
        where = HOST if strategy.offload_params else ""
        static[f"{where}parameter partition"] = shard * b["param"]
        static["persistent parameters"] = facts.persistent * b["compute"]
        # DeepSpeed keeps a unit gathered until its next use when fewer than
        # ``stage3_max_reuse_distance`` parameters run in between (the coordinator's
        # ``__params_to_release``); ``stage3_max_live_parameters`` caps prefetch only.
        prefetch = int(zero["stage3_prefetch_bucket_size"])
        live_cap = int(zero["stage3_max_live_parameters"])
        retained, across_step = _reuse_retained(segments, units, int(zero["stage3_max_reuse_distance"]))
        run: list[tuple[str, Parts]] = []
        for (ph, u, top, _), kept in zip(segments, retained, strict=True):
            running = unit(u) if u >= 0 else facts.root
            ahead = min(prefetch, facts.largest_unit, max(0, live_cap - running - kept))
            run.append((name(ph, u), {"activations": top,
                                      "gathered parameters": (running + ahead) * b["compute"],
                                      "parameters kept for reuse": kept * b["compute"],
                                      **(grads if ph == "backward" else {})}))
        step["parameters kept for reuse"] = across_step * b["compute"]
        return _peak(static, run, step, points)

    if strategy.engine == "fsdp1" and n == 1 and not strategy.offload_params:
        # At world size 1 FSDP1 switches to NO_SHARD (docs/design.md, pitfall 49):
        # parameters used in place (nothing gathered), gradients made in backward and
        # kept to the step, as DDP without buckets (equal to the CPU count).
        static = {"params": P * b["param"], "optimizer": T * states}
        step = {"gradients": T * b["grad"], "optimizer step temporaries": T * temp}
        return _peak(static, [("forward/backward", {"activations": trace.peak_with_grads})], step, points)

    # FSDP2 / FSDP1: sharded parameters, gradients and optimizer states (on the host with
    # offload); the root's parameters stay gathered from forward to backward (neither
    # reshards the root); while a unit runs its parameters are gathered, in backward the
    # next unit is prefetched and, as the unit ends, its unsharded gradients and the
    # reduce-scatter input exist. Without resharding a unit stays gathered from its
    # forward to its backward.
    off = HOST if strategy.offload_params else ""
    # A quantized base (QLoRA) shards, gathers and keeps its packed bytes.
    stored = -(-facts.stored(P, facts.quantized, b["param"]) // n)
    static = {f"{off}sharded parameters + optimizer": stored + trained_shard * states}
    reshard = strategy.stage == 3

    # FSDP2's float8 all-gather moves and holds one byte per float8 weight.
    float8_saving = b["compute"] - 1 if facts.gathers_float8(strategy.engine) else 0

    def gathered_bytes(i: int) -> int:
        return (facts.stored(unit(i), facts.unit_quantized_count(i), b["compute"])
                - facts.unit_float8_count(i) * float8_saving)

    order = [u for ph, u, _, _ in segments if ph == "forward" and u >= 0]
    run = []
    done_fwd: set[int] = set()
    done_bwd: set[int] = set()
    root = facts.stored(facts.root, facts.root_quantized, b["compute"]) - facts.root_float8 * float8_saving
    # The root's gradients stay unsharded until backward ends (it is reduced last): none
    # at the first backward stretch's top, a head's from its end, the rest (an
    # embedding's, `StepTrace.root_grads_last`) from the end of the stretch after the
    # last unit.
    root_grads = 0
    all_root_grads = facts.root_trained * b["grad"]
    head_root_grads = all_root_grads - round(all_root_grads * trace.root_grads_last)
    gathered = 0  # sum of gathered_bytes(i) over done_fwd - done_bwd, kept as the sets change
    in_flight = 0  # FSDP2: the reduce-scatter input of the unit reduced last, still held
    pending = len(order) - 1  # order[pending]: the unit backward runs next (done_bwd only grows)
    for ph, u, top, end in segments:
        if ph == "forward":
            if u >= 0 and u not in done_fwd:
                done_fwd.add(u)
                if u not in done_bwd:
                    gathered += gathered_bytes(u)
            kept = gathered if not reshard else gathered_bytes(u)
            run.append((name(ph, u), {"activations": top, "gathered parameters": root + kept}))
            continue
        if u >= 0 and u not in done_bwd:
            done_bwd.add(u)
            if u in done_fwd:
                gathered -= gathered_bytes(u)
        while pending >= 0 and order[pending] in done_bwd:
            pending -= 1
        nxt = order[pending] if pending >= 0 else -1  # forward order reversed; -1: none left
        kept = (gathered + gathered_bytes(u)) if not reshard else gathered_bytes(u) + gathered_bytes(nxt)
        held = {"gathered parameters": root + kept, "root gradients": root_grads,
                f"{off}sharded gradients": trained_shard * b["reduce"] * max(0, len(done_bwd) - 1) // max(1, len(units)),
                "previous unit's reduce-scatter input": in_flight}
        run.append((name(ph, u), {"activations": top, **held}))
        # A gradient still being made is in the trace's activations; it is the root's
        # from the stretch's end on.
        root_grads = all_root_grads if u < 0 and len(done_bwd) == len(order) else max(root_grads, head_root_grads)
        held["root gradients"] = root_grads
        if reshard:  # both reshard the unit's parameters before reducing its gradients
            held["gathered parameters"] = root + gathered_bytes(nxt)
        # FSDP1 reduce-scatters the unit's flat gradient itself; FSDP2 copies the
        # gradients into a reduce-scatter input of its own (both measured) and keeps it
        # until the next unit's reduce begins (torch 2.13's reduce_scatter_states, one
        # buffer by default: the collective may still be reading it), so it is held
        # through the next unit's backward.
        fsdp2 = strategy.engine == "fsdp2"
        reduce = facts.unit_trained(u) * (b["grad"] + (b["reduce"] if fsdp2 else 0))
        run.append((name(ph, u) + " end", {"activations": end, **held, "previous unit's reduce-scatter input": 0,
                                           "unsharded gradients + reduce-scatter input": reduce}))
        if fsdp2 and u >= 0:
            in_flight = facts.unit_trained(u) * b["reduce"]
    step = {f"{off}sharded gradients": trained_shard * b["reduce"],
            "optimizer step temporaries": 0 if off else trained_shard * temp}
    return _peak(static, run, step, points)


def _reuse_retained(segments: tuple[tuple[str, int, int, int], ...], units: tuple[int, ...],
                    distance: int) -> tuple[list[int], int]:
    """Parameters (elements) of units other than the running one that ZeRO-3 keeps
    gathered at each stretch of ``segments``, and across the optimizer step: a unit stays
    gathered from one use to its next (the step repeating cyclically) when the units run
    in between hold fewer than ``distance`` parameters. Unit granularity (DeepSpeed
    decides per submodule) and the root's parameters not counted in between."""
    visits = [u for _, u, _, _ in segments]
    m = len(visits)
    sizes = [units[u] if 0 <= u < len(units) else 0 for u in visits]
    prefix = [0]
    for i in range(2 * m):
        prefix.append(prefix[-1] + sizes[i % m])
    extra = [0] * (2 * m + 1)  # a difference array over two cycles
    positions: dict[int, list[int]] = {}
    for i, u in enumerate(visits):
        if 0 <= u < len(units):
            positions.setdefault(u, []).append(i)
    across = 0
    for u, seen in positions.items():
        for here, there in zip(seen, [*seen[1:], seen[0] + m], strict=True):
            if there - here > 1 and prefix[there] - prefix[here + 1] < distance:
                extra[here + 1] += units[u]
                extra[there] -= units[u]
                across += units[u] if there >= m else 0
    kept, running = [0] * m, 0
    for i in range(2 * m):
        running += extra[i]
        kept[i % m] += running
    return kept, across


def _peak(static: Parts, stretches: list[tuple[str, Parts]], step: Parts,
          points: list[tuple[int, int]] | None = None) -> RankMemory:
    """The device peak over the stretches and the step; host: the most the host parts
    ever sum to; ``combined``: the peak of both together (one memory, as on a CPU run)."""
    # Each candidate is ``{**static, **parts}``; its sums are taken from static's and
    # the few keys ``parts`` adds or overrides, without building the merged dict (the
    # budget solver asks for thousands of these on a deep model: issue #31's speed).
    static_device = sum(v for k, v in static.items() if not k.startswith(HOST))
    static_total = sum(static.values())
    best = (-1, "", step)
    host = combined = 0
    for phase, parts in [*stretches, ("optimizer step", step)]:
        device, total = static_device, static_total
        for k, v in parts.items():
            replaced = static.get(k, 0)
            total += v - replaced
            if not k.startswith(HOST):
                device += v - replaced
        host, combined = max(host, total - device), max(combined, total)
        if points is not None:
            points.append((device, parts.get("activations", 0)))
        if device > best[0]:
            best = (device, phase, parts)
    device, phase, parts = best
    merged = {**static, **parts}
    return RankMemory(device=device, host=host, phase=phase, parts={k: v for k, v in merged.items() if v},
                      combined=combined)


def _ds_defaults(zero: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed 0.19's defaults for what a config leaves out (`ZERO_DEFAULTS`)."""
    stage = int(zero.get("stage", 0))
    return {"stage": stage, "overlap_comm": stage == 3, **ZERO_DEFAULTS, **zero}


def _float8_gathered(model: Any, plan: Any) -> set[int]:
    """Ids of the weights FSDP2 gathers in float8 under ``plan``: every float8 linear's,
    when every float8 unit is tensorwise (`annot.float8.default_all_gather`)."""
    from annot.float8 import default_all_gather
    from annot.policies.speed import float8_linears

    if not default_all_gather(plan, "fsdp2", None):
        return set()
    return {id(model.get_submodule(path).weight) for path in float8_linears(model, plan.units).paths}


def model_facts(model: Any, plan: Any, persistence_threshold: int = PERSISTENCE_THRESHOLD, *,
                quantized: Collection[int] = (), quantized_costs: QuantizedCosts | None = None) -> ModelFacts:
    """`ModelFacts` of ``model`` (meta is fine) under ``plan`` (an `annot.Plan`).
    ``quantized``: ids of the parameters a quantized base holds quantized (priced at
    ``quantized_costs``)."""
    from annot.policies import Action

    params = {id(p): p for p in model.parameters()}
    owner: dict[int, int] = {}
    shard_units = [u for u in plan.units if u.has(Action.SHARD)]
    for index, u in enumerate(shard_units):
        for path in u.modules:
            for p in model.get_submodule(path).parameters():
                owner.setdefault(id(p), index)
    sizes = [0] * len(shard_units)
    trained = [0] * len(shard_units)
    for key, p in params.items():
        if key in owner:
            sizes[owner[key]] += p.numel()
            trained[owner[key]] += p.numel() if p.requires_grad else 0
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    persistent = sum(p.numel() for p in params.values() if p.numel() <= persistence_threshold)
    if trainable == total:  # every parameter trains: the counts are the sizes
        facts = ModelFacts(params=total, units=tuple(sizes), root=total - sum(sizes), persistent=persistent)
    else:
        facts = ModelFacts(params=total, units=tuple(sizes), root=total - sum(sizes), persistent=persistent,
                           trainable=trainable, unit_trainable=tuple(trained),
                           root_trainable=trainable - sum(trained))
    gathered_in_float8 = _float8_gathered(model, plan)
    if gathered_in_float8:
        per_unit = [0] * len(shard_units)
        for key in gathered_in_float8:
            if key in owner:
                per_unit[owner[key]] += params[key].numel()
        facts = dataclasses.replace(facts, unit_float8=tuple(per_unit),
                                    root_float8=sum(params[k].numel() for k in gathered_in_float8) - sum(per_unit))
    if not quantized:
        return facts
    in_units = [0] * len(shard_units)
    for key in quantized:
        if key in owner:
            in_units[owner[key]] += params[key].numel()
    return dataclasses.replace(
        facts, unit_quantized=tuple(in_units),
        root_quantized=sum(params[key].numel() for key in quantized) - sum(in_units),
        quantized_costs=quantized_costs)
