"""`estimate_memory`: per-rank memory of every strategy, whether each fits, and the
fastest one that does, written as the `annot.auto_wrap` call that builds it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from annot.memory.activations import (
    ActivationEstimate,
    InputsFn,
    StepTrace,
)
from annot.memory.choices import DEVICES
from annot.memory.communication import (
    INTER_NODE_BW,
    INTRA_NODE_BW,
    TFLOPS,
    Dtypes,
    Network,
    ParamRecord,
    StepCommunication,
    local_numel,
    param_records,
    step_collectives,
    step_communication,
    strategy_layout,
    tp_styles,
)
from annot.memory.context_parallel import (
    AttentionShape,
    attention_shape,
    cp_collectives,
    cp_extra_flops,
    cp_gathered_bytes,
    cp_strategies,
)
from annot.memory.engine_memory import (
    OPTIMIZERS,
    ModelFacts,
    RankMemory,
    _bytes,
    model_facts,
    rank_memory,
)
from annot.memory.gpu_kinds import DEFAULT_GPU, GPU_KINDS, GpuKind, gpu_kind
from annot.memory.inputs import MediaSizes, batch_and_seq, example_batch, model_inputs
from annot.memory.quantized_base import (
    QUANTIZED_KEYS,
    QuantizedBase,
    dequantization_in_trace,
    from_pretrained_call,
    priced_base,
)
from annot.memory.representative import fast_trace_activations, fast_trace_step
from annot.memory.strategies import (
    PRECISIONS,
    STRATEGIES,
    MemoryInputError,
    Strategy,
    layout_strategies,
)
from annot.memory.user_config import (
    USER_DEEPSPEED_KEY,
    UserDeepSpeed,
    ddp_strategy,
    read_deepspeed_config,
)
from annot.policies import Action, Plan, Policy, Rule, make_plan
from annot.policies.model_index import is_under
from annot.policies.plan import format_bytes
from annot.policies.rules import format_count
from annot.policies.speed import with_speed_actions

__all__ = ["MARGIN", "RESERVE", "MemoryReport", "StepTime", "StrategyRow", "estimate_memory"]

GiB = 2**30
DDP_LIMIT_PARAMS = 500_000_000  # the seeds' rule of thumb: DDP below about 500M parameters
#: What no count sees, added to every counted GPU peak before comparing with the GPU's
#: memory: ``MARGIN`` of the peak (the caching allocator's rounding and fragmentation)
#: plus a reserve (the CUDA context, cuBLAS workspaces, NCCL's buffers per communicator),
#: by default from the GPU kind's table (`annot.memory.gpu_kinds`) for each strategy's
#: communicators. ``RESERVE`` is that table's figure for one H100 process with one
#: communicator. Counted CPU runs verify the counted part only
#: (tests/memory/test_counted.py); both are configurable per call (``margin=``,
#: ``reserve=``).
MARGIN = 0.10
RESERVE = GPU_KINDS[DEFAULT_GPU].reserve(1)
# Fastest first. Checkpointing costs about a third more compute; sharding parameters
# costs all-gathers, offload costs host transfers.
PREFERENCE: tuple[tuple[str, bool], ...] = (
    ("ddp", False), ("zero1", False), ("zero2", False),
    ("ddp", True), ("zero1", True), ("zero2", True),
    ("fsdp2-no-reshard", False), ("fsdp2", False), ("zero3", False),
    ("fsdp2-no-reshard", True), ("fsdp2", True), ("zero3", True),
    ("zero2-offload", True), ("zero3-offload-opt", True),
    ("fsdp2-offload", True), ("zero3-offload", True),
    ("zero3-nvme-opt", True), ("zero3-nvme", True),
)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One training step of a strategy on the `Network`: ``flops`` per GPU (the traced
    step's, tensor-parallel layers divided), ``compute`` seconds at the stated
    throughput, the network's ``comm`` (`annot.memory.communication`), and ``tokens``
    the whole job trains per step."""

    flops: int
    compute: float
    comm: StepCommunication
    tokens: int

    @property
    def overlapped(self) -> float:
        """Seconds if every collective hides behind compute: ``max(compute, comm)``."""
        return max(self.compute, self.comm.seconds)

    @property
    def serial(self) -> float:
        """Seconds if no collective hides behind compute: ``compute + comm``."""
        return self.compute + self.comm.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.overlapped if self.overlapped else float("inf")


@dataclasses.dataclass(frozen=True)
class StrategyRow:
    """One strategy: its per-rank device peak without and with the Plan's checkpointing
    (counted bytes; ``fits`` adds the margin), host memory per node, NVMe per node."""

    key: str
    label: str
    call: str
    gpu: int
    gpu_checkpointed: int
    host: int
    nvme: int
    fits: bool
    fits_checkpointed: bool
    detail: RankMemory
    detail_checkpointed: RankMemory
    #: The step's communication and time without and with the Plan's checkpointing.
    time: StepTime | None = None
    time_checkpointed: StepTime | None = None

    @property
    def run_time(self) -> StepTime | None:
        """The step time of the variant this row would run: plain if it fits, else
        checkpointed if that fits, else plain."""
        return self.time_checkpointed if self.fits_checkpointed and not self.fits else self.time


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Everything `annot plan --memory` prints; `to_dict()` is its ``--json``."""

    model: str
    params: int
    largest_unit_params: int
    gpus_per_node: int
    nodes: int
    precision: str
    optimizer: str
    batch: int
    seq: int
    gpu_mem: int
    host_mem: int
    margin: float
    reserve: int
    activations: ActivationEstimate
    rows: tuple[StrategyRow, ...]
    recommendation: str | None
    checkpoint: bool | None
    reason: str
    network: Network | None = None
    #: The ``auto_wrap`` call of the recommendation.
    call: str | None = None
    #: Layouts not weighed, each (label, why): a tensor-parallel layout the model's
    #: ``_tp_plan`` cannot give.
    unavailable: tuple[tuple[str, str], ...] = ()
    #: The GPU kind whose reserve table applied (`annot.memory.gpu_kinds`).
    gpu_kind: str = DEFAULT_GPU
    #: What the trace assumed of values it could not know (balanced routing, the
    #: inputs' values: `annot.memory.routing_values`), printed under the table.
    assumptions: tuple[str, ...] = ()
    #: What the traced step was fed, in words (printed under the table).
    fed: str = ""

    def row(self, key: str) -> StrategyRow:
        return next(r for r in self.rows if r.key == key)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        header = ("strategy", "GPU peak", "GPU w/ ckpt", "host/node", "NVMe/node", "fits",
                  "sent/GPU in node", "across nodes", "step", "serial")
        rows = []
        for r in self.rows:
            fits = ("yes" if r.fits else "ckpt" if r.fits_checkpointed else "no")
            mark = " <-" if r.key == self.recommendation else ""
            t = r.run_time
            timing: tuple[str, ...] = ("-",) * 4
            if t is not None:
                timing = (format_bytes(t.comm.intra), format_bytes(t.comm.inter),
                          _seconds(t.overlapped), _seconds(t.serial))
            rows.append((r.label, format_bytes(r.gpu), format_bytes(r.gpu_checkpointed),
                         format_bytes(r.host), format_bytes(r.nvme) if r.nvme else "-", fits + mark,
                         *timing))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        a = self.activations
        lines = [
            f"Memory for {self.model}: {format_count(self.params)} params, {self.precision}, "
            f"{self.optimizer}; {self.nodes} node(s) x {self.gpus_per_node} GPU(s); "
            f"batch {self.batch} x seq {self.seq} per GPU",
            f"activations saved for backward: {format_bytes(a.saved)} without checkpointing, "
            f"{format_bytes(a.saved_checkpointed)} + {format_bytes(a.recompute_peak)} recompute "
            f"peak with the plan's checkpointing ({len(a.per_unit)} units)",
            f"limits: {format_bytes(self.gpu_mem)} per GPU (counted peak + {self.margin:.0%} "
            f"+ {format_bytes(self.reserve)} must fit: {self.gpu_kind} CUDA context, cuBLAS "
            f"workspaces, NCCL buffers per communicator), {format_bytes(self.host_mem)} per host",
        ]
        if self.network is not None:
            n = self.network
            lines.append(
                f"network: {n.intra_node_bw / 1e9:g} GB/s per GPU inside a node, "
                f"{n.inter_node_bw / 1e9:g} GB/s per node across nodes, {n.flops / 1e12:g} TFLOP/s "
                "per GPU; bytes each GPU sends per step (ring collectives); step = max(compute, "
                "comm) if collectives overlap compute, serial = compute + comm; a TP row's "
                "tensor-parallel group shares one micro-batch")
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        for label, why in self.unavailable:
            lines.append(f"{label.ljust(widths[0])}  unavailable: {why}")
        lines.append(f"recommendation: {self.reason}")
        if self.call is not None:
            lines.append(f"  {self.call}")
        if self.fed:
            lines.append(f"inputs: {self.fed}")
        lines.extend(f"note: {text}" for text in self.assumptions)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _seconds(s: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``4.5`` -> ``"4.50 s"``."""
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _gpu_kind_and_memory(gpu: str | None) -> tuple[GpuKind, int]:
    """The GPU kind (named, else the visible GPU's, else `DEFAULT_GPU`) and its memory
    (the visible GPU's own total when none is named)."""
    if gpu is None and torch.cuda.is_available():
        return gpu_kind(None, torch.cuda.get_device_name(0)), torch.cuda.get_device_properties(0).total_memory
    kind = gpu_kind(gpu)
    return kind, kind.memory


def communicators(strategy: Strategy, world: int) -> int:
    """NCCL communicators one rank of ``strategy`` holds: none alone, one over the world,
    one more per further mesh dimension (HSDP's replicate, tensor parallelism)."""
    if world <= 1:
        return 0
    return max(1, len(strategy.mesh))


def _default_host_mem() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _trace_setting(strategy: Strategy, precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(parameter dtype, autocast dtype) of the compute for ``strategy`` at ``precision``."""
    half = torch.float16 if precision == "fp16-mixed" else torch.bfloat16
    if precision == "fp32":
        return None, None
    if precision == "amp" or (strategy.engine == "ddp" and precision.endswith("-mixed")):
        return None, half
    return half, None


def strategy_memory(strategy: Strategy, trace: StepTrace, facts: ModelFacts, plan: Plan, *,
                    world: int, precision: str, optimizer: str,
                    records: tuple[ParamRecord, ...] | None = None,
                    styles: dict[str, str] | None = None,
                    attention: AttentionShape | None = None,
                    ds_zero: dict[str, Any] | None = None,
                    points: list[tuple[int, int]] | None = None) -> RankMemory:
    """`rank_memory` of ``strategy`` with the config annot writes for it, on ``trace``
    (the training step traced in ``strategy``'s precision setting, `_trace_setting`).

    Two-dimensional layouts (`Strategy.mesh`): HSDP and ``HYBRID_SHARD`` hold what the
    shard group's ranks would on their own; tensor parallelism divides the split layers'
    parameters (``records`` and their ``styles``) before FSDP2 shards them over
    ``shard`` (activations are counted whole: an upper bound, as the split layers'
    interiors shrink too); hpZ adds its secondary partition, the parameters over the
    ``hpz_partition_size`` ranks of a node. Context parallelism (a ``cp`` dimension:
    ``trace`` is of the sequence one rank holds) shards over ``shard x cp`` and adds the
    other ranks' keys and values (``attention``, `annot.memory.context_parallel`).
    ``ds_zero``: a DeepSpeed strategy's ``zero_optimization`` section when it is the
    user's (`annot.memory.user_config`) rather than the one annot writes. ``points``:
    as for `rank_memory` (the terms added here come after it).
    """
    layout = strategy_layout(strategy, world)
    zero = None
    hpz = int(strategy.option("hpz_partition_size", 1))
    if strategy.engine == "deepspeed" and ds_zero is not None:
        zero = ds_zero
    elif strategy.engine == "deepspeed":
        from annot.engines.deepspeed_config import deepspeed_config

        options = strategy.engine_options(precision)
        options.pop("hpz_partition_size", None)  # no memory of its own in the config's buffers
        precision_name = options.pop("mixed_precision", None)
        zero = deepspeed_config(plan, precision=precision_name, **options)["zero_optimization"]
    if layout.tp > 1:
        if records is None or styles is None:
            raise MemoryInputError(f"{strategy.label}: tensor parallelism needs the parameter "
                                   "records and the tensor-parallel styles")
        facts = _tp_facts(facts, records, styles, layout.tp)
    memory = rank_memory(strategy, trace, facts,
                         world=layout.shard * layout.cp if strategy.mesh else world,
                         precision=precision, optimizer=optimizer, ds_zero=zero,
                         ddp_bucket_view=bool(strategy.option("gradient_as_bucket_view", True)),
                         points=points)
    if layout.cp > 1:
        if attention is None:
            raise MemoryInputError(f"{strategy.label}: context parallelism needs the attention shape")
        gathered = cp_gathered_bytes(attention, batch=trace.batch, seq=trace.seq * layout.cp,
                                     cp=layout.cp, act_bytes=4 if precision == "fp32" else 2,
                                     checkpoint=trace.checkpoint,
                                     attention=strategy.option("cp_attention", "allgather"))
        what = ("cp: repeated key/value heads" if strategy.option("cp_attention") == "ulysses"
                else "cp: other ranks' keys and values")
        memory = dataclasses.replace(
            memory, device=memory.device + gathered, combined=memory.combined + gathered,
            parts={**memory.parts, what: gathered})
    if hpz > 1:
        secondary = -(-facts.params // hpz) * _bytes(precision, strategy.engine, optimizer)["param"]
        memory = dataclasses.replace(
            memory, device=memory.device + secondary, combined=memory.combined + secondary,
            parts={**memory.parts, "hpZ secondary partition": secondary})
    return memory


def _tp_facts(facts: ModelFacts, records: tuple[ParamRecord, ...], styles: dict[str, str],
              tp: int) -> ModelFacts:
    """``facts`` with each parameter as large as one tensor-parallel rank's piece."""
    units = [0] * len(facts.units)
    trained = [0] * len(facts.units)
    root = root_trained = 0
    for r in records:
        n = local_numel(r, styles.get(r.module), tp)
        if 0 <= r.unit < len(units):
            units[r.unit] += n
            trained[r.unit] += n if r.trainable else 0
        else:
            root += n
            root_trained += n if r.trainable else 0
    if facts.trainable is None:
        return ModelFacts(params=sum(units) + root, units=tuple(units), root=root,
                          persistent=facts.persistent)
    return ModelFacts(params=sum(units) + root, units=tuple(units), root=root, persistent=facts.persistent,
                      trainable=sum(trained) + root_trained, unit_trainable=tuple(trained),
                      root_trainable=root_trained)


def step_time(strategy: Strategy, trace: StepTrace, plan: Plan, model: nn.Module,
              records: tuple[ParamRecord, ...], network: Network, *, precision: str,
              optimizer: str, styles: dict[str, str] | None = None,
              attention: AttentionShape | None = None) -> StepTime:
    """Compute, communication and step time of ``strategy`` for the step ``trace``
    (`StepTime`, `annot.memory.communication`)."""
    from annot.engines.deepspeed_config import PERSISTENCE_THRESHOLD

    layout = strategy_layout(strategy, network.world)
    b = _bytes(precision, strategy.engine, optimizer)
    dtypes = Dtypes(gather=b["compute"], reduce=b["reduce"] if strategy.engine in ("fsdp1", "fsdp2")
                    else b["grad"], activation=4 if precision == "fp32" else 2)
    styles = styles or {}
    tp = None
    flops = trace.flops
    if layout.tp > 1:
        recomputed = set(plan.paths(Action.CHECKPOINT)) if trace.checkpoint else set()
        tp = (model, styles, trace.batch * trace.seq, recomputed)
        # A split Linear's matmuls (2 x tokens x in x out in forward and in recomputation,
        # twice that in backward) run 1/tp on each rank; the rest (attention scores, norms)
        # are counted whole, an upper bound.
        split = sum(_linear_matmul_flops(model, path, trace, recomputed) for path in styles
                    if isinstance(model.get_submodule(path), nn.Linear))
        flops -= split - split // layout.tp
    # FSDP2 shards over shard x cp as one dimension (annot.engines.mesh).
    collectives = step_collectives(
        strategy.engine, stage=strategy.stage, records=records, layout=layout.flattened(),
        dtypes=dtypes, hpz=int(strategy.option("hpz_partition_size", 1)),
        persistence_threshold=PERSISTENCE_THRESHOLD, tp=tp)
    comm = step_communication(collectives, layout.flattened(), network)
    if layout.cp > 1:
        if attention is None:
            raise MemoryInputError(f"{strategy.label}: context parallelism needs the attention shape")
        whole = trace.seq * layout.cp
        cp_comm = step_communication(
            cp_collectives(attention, batch=trace.batch, seq=whole, cp=layout.cp,
                           act_bytes=dtypes.activation, checkpoint=trace.checkpoint,
                           attention=strategy.option("cp_attention", "allgather")),
            layout, network)
        comm = StepCommunication(comm.collectives + cp_comm.collectives, comm.intra + cp_comm.intra,
                                 comm.inter + cp_comm.inter, comm.seconds + cp_comm.seconds,
                                 comm.inter_seconds + cp_comm.inter_seconds)
        flops += cp_extra_flops(attention, batch=trace.batch, seq=whole, cp=layout.cp,
                                checkpoint=trace.checkpoint)
    # The float8 linears' matmuls run at the GPU's float8 rate (`Network.float8_speedup`).
    float8 = _float8_matmul_flops(model, plan, trace, set(styles), layout.tp)
    compute = (flops - float8) / network.flops + float8 / (network.flops * network.float8_speedup)
    return StepTime(flops=flops, compute=compute, comm=comm,
                    tokens=trace.batch * trace.seq * network.world // layout.tp)


def _float8_matmul_flops(model: nn.Module, plan: Plan, trace: StepTrace, split: set[str], tp: int) -> int:
    """The FLOPs of the float8 linears' matmuls in the step ``trace``
    (`_linear_matmul_flops`), a tensor-parallel split linear's divided by ``tp``."""
    if not plan.paths(Action.FLOAT8):
        return 0
    from annot.policies.speed import float8_linears

    recomputed = set(plan.paths(Action.CHECKPOINT)) if trace.checkpoint else set()
    total = 0
    for path in float8_linears(model, plan.units).paths:
        flops = _linear_matmul_flops(model, path, trace, recomputed)
        total += flops // tp if path in split else flops
    return total


def _linear_matmul_flops(model: nn.Module, path: str, trace: StepTrace, recomputed: set[str]) -> int:
    """The FLOPs of the matmuls of the linear at ``path`` in the step ``trace``: 2 x tokens
    x in x out in forward and again in a recomputation (inside a unit of ``recomputed``),
    twice that in backward; 0 for a module without a weight."""
    weight = getattr(model.get_submodule(path), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return 0
    again = any(is_under(path, unit) for unit in recomputed)
    return (6 + 2 * again) * trace.batch * trace.seq * weight.numel()


def estimate_memory(
    model: nn.Module,
    plan: Plan | Policy | Rule | None = None,
    *,
    gpus: int = 1,
    nodes: int = 1,
    batch: int = 1,
    seq: int = 2048,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    gpu_mem: int | None = None,
    host_mem: int | None = None,
    margin: float = MARGIN,
    reserve: int | None = None,
    inputs: InputsFn | None = None,
    intra_node_bw: float = INTRA_NODE_BW,
    inter_node_bw: float = INTER_NODE_BW,
    tflops: float = TFLOPS,
    tp_plan: dict[str, str] | None = None,
    cp: tuple[int, ...] = (),
    cp_attention: str = "allgather",
    deepspeed_config: dict[str, Any] | str | os.PathLike[str] | None = None,
    ddp_options: dict[str, Any] | None = None,
    gpu: str | None = None,
    media: MediaSizes | None = None,
    example_inputs: Mapping[str, Any] | None = None,
    quantize: str | None = None,
    unquantized: Rule | str | None = None,
    float8: str | None = None,
) -> MemoryReport:
    """Per-GPU and per-host memory of every strategy for ``model`` (build it on the meta
    device: nothing is allocated), each one's communication and step time, and the
    fastest strategy that fits.

    ``gpus`` is GPUs per node; ``batch`` the micro-batch per GPU; ``gpu_mem``/``host_mem``
    in bytes (defaults: the ``gpu`` kind's, else the visible GPU's, else an H100's 79.6 GiB;
    this machine's RAM). ``gpu``: ``"H100"``, ``"H200"``, ``"A100"``, ``"A100-40GB"``
    (`annot.memory.gpu_kinds`). ``plan`` may be
    a Plan, or a policy/rule to build one (default: the model's marks / HF metadata); its
    checkpoint units are what "with checkpointing" means. A strategy fits when its
    counted peak x (1 + ``margin``) + ``reserve`` is at most ``gpu_mem``; ``reserve``
    defaults to the GPU kind's context, cuBLAS workspaces and NCCL buffers for the
    strategy's communicators (`GpuKind.reserve`). The optimizer is
    torch's (foreach, as on GPUs).

    The network (`annot.memory.communication`): ``intra_node_bw`` GB/s each GPU sends
    inside its node, ``inter_node_bw`` GB/s each node sends to the others, ``tflops``
    TFLOP/s each GPU computes. On more than one node the two-dimensional layouts are
    weighed too (`annot.memory.strategies.layout_strategies`); ``tp_plan`` (module-path
    patterns to styles, as transformers' ``_tp_plan``; default the model's own, else
    Linear layers by name; ``{}``: no tensor-parallel row) says what tensor parallelism
    splits. When the recommended strategy's step is bound by the inter-node link, the
    fastest two-dimensional layout that fits replaces it.

    ``cp``: context-parallel sizes to weigh, each a row ``FSDP2 + CP c`` (each sequence
    of ``seq`` tokens split over ``c`` ranks of a node, parameters sharded over every
    rank; `annot.memory.context_parallel`), preferred after the strategies that keep
    model states on the GPU and before offload. Default none. ``cp_attention``:
    ``"allgather"`` (keys and values gathered) or ``"ulysses"`` (all-to-all over heads),
    as FSDP2's option of that name.
    ``deepspeed_config``: your DeepSpeed config (a dict, or the path of its JSON file).
    Its strategy is one more row, key ``"deepspeed-config"``, modelled from that config
    (ZeRO stage, offload, buckets, prefetch, live and reuse limits, persistence
    threshold; its ``fp16``/``bf16`` section for the precision, whatever ``precision``
    says; `annot.memory.user_config`). A key DeepSpeed does not know is an error naming it.
    ``ddp_options``: the DDP row as you run DDP; ``{"gradient_as_bucket_view": False}``
    (torch's default, annot's is True) keeps each gradient beside its bucket copy.

    What the traced step is fed: by default what the model's class takes
    (`annot.memory.inputs.model_inputs`: token ids for a text model; images and their
    tokens for a vision-language model, mel features for a speech model, decoder inputs
    for a sequence-to-sequence one, noisy latents and a flow-matching loss for a diffusers
    denoiser), sized by ``media`` (`MediaSizes`: image size and count, audio frames,
    latent size, frames, prompt tokens); or ``example_inputs``, a batch of yours (the
    forward's keyword arguments, one GPU's micro-batch: ``batch`` and ``seq`` then come
    from it); or ``inputs``, a function of your own. What was fed is said under the
    table. Parameters that do not train (a frozen tower, a LoRA base) are priced without
    gradients, master copies or optimizer states.

    ``quantize="nf4"``: the frozen base quantized as ``annot.from_pretrained(...,
    quantize="nf4")`` does it (the same linears, `annot.quantization.choose_linears`, on
    the ranks of each strategy), priced by what torchao's NF4 holds (packed codes and
    scales, sharded and gathered by FSDP2) and the peak of dequantizing the largest
    quantized weight, both counted on torchao (`annot.memory.quantized_base`). Only the
    DDP and FSDP2 rows are weighed: the engines annot trains a quantized base on (DDP
    priced with the linears FSDP2 would quantize on these ranks: a weight that does not
    split into whole blocks over them is quantized under DDP, a little less memory). The stored
    dtype is bf16 for ``precision="bf16"``, else fp32. ``unquantized``: the rule of
    modules whose linears stay in the model's dtype, as ``from_pretrained`` takes it.
    ``float8``: a recipe, as ``auto_wrap(float8=...)`` takes it: the Plan's float8 units
    (else its repeated blocks) traced with torchao's float8 linears (their casts and what
    they save for backward counted), and FSDP2's rows gathering their weights in float8
    where auto_wrap does (every float8 unit tensorwise).
    """
    wrappers = {"DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"}
    if any(hasattr(p, "device_mesh") for p in model.parameters()) or any(
            k.__name__ in wrappers for k in type(model).__mro__):
        raise MemoryInputError(
            "estimate_memory() takes the bare model (best built on the meta device), not one "
            "already wrapped or sharded by an engine")
    if not isinstance(plan, Plan):
        plan = make_plan(model, plan)
    if float8 is not None:
        if quantize is not None:
            raise MemoryInputError("float8= with quantize=: annot does not train a quantized base in float8")
        plan = with_speed_actions(plan, model, float8=float8)
    if precision not in PRECISIONS:
        raise MemoryInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise MemoryInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if gpus < 1 or nodes < 1:
        raise MemoryInputError("--gpus and --nodes must be at least 1")
    kind, kind_mem = _gpu_kind_and_memory(gpu)
    network = Network(gpus_per_node=gpus, nodes=nodes, intra_node_bw=intra_node_bw * 1e9,
                      inter_node_bw=inter_node_bw * 1e9, flops=tflops * 1e12,
                      float8_speedup=DEVICES[kind.name].float8_speedup if kind.name in DEVICES else 1.0)
    gpu_mem = gpu_mem if gpu_mem is not None else kind_mem
    host_mem = host_mem if host_mem is not None else _default_host_mem()
    user_ds = read_deepspeed_config(deepspeed_config) if deepspeed_config is not None else None
    ddp = ddp_strategy(ddp_options)
    if example_inputs is not None:
        if inputs is not None or media is not None:
            raise MemoryInputError("pass example_inputs= alone: it replaces inputs= and media=")
        inputs = example_batch(example_inputs)
        batch, seq = batch_and_seq(example_inputs)
        fed = f"traced on your batch ({', '.join(sorted(example_inputs))})"
    elif inputs is None:
        inputs = model_inputs(media)
        fed = (media or MediaSizes()).describe(model, batch, seq)
    else:
        fed = "traced on the inputs of your inputs= function"
    styles, unavailable = _tensor_parallel_styles(model, tp_plan, network)
    base = priced_base(model, quantize, precision, network.world, unquantized)
    if base is not None:
        if user_ds is not None or cp:
            raise MemoryInputError("quantize= prices DDP and FSDP2 rows only: leave out deepspeed_config= and cp=")
        styles, unavailable = {}, ()
    rows, activations, strategies, assumptions = _rows(
        model, plan, network=network, batch=batch, seq=seq, precision=precision,
        optimizer=optimizer, gpu_mem=gpu_mem, host_mem=host_mem, margin=margin, reserve=reserve,
        inputs=inputs, styles=styles, cp=tuple(cp), user_ds=user_ds, ddp=ddp, kind=kind,
        cp_attention=cp_attention, quantized=base)
    if base is not None:
        assumptions = (*assumptions, base.said)
    key, checkpoint, reason = _recommend(rows, plan.total_params, gpu_mem, bool(activations.per_unit),
                                         cp=tuple(cp))
    if nodes > 1 and key is not None:
        key, checkpoint, reason = _prefer_network(rows, key, checkpoint, reason)
    return MemoryReport(
        model=type(model).__name__, params=plan.total_params,
        largest_unit_params=max([u.params for u in plan.units] + [plan.root.params]),
        gpus_per_node=gpus, nodes=nodes, precision=precision, optimizer=optimizer, batch=batch,
        seq=seq, gpu_mem=gpu_mem, host_mem=host_mem, margin=margin,
        reserve=reserve if reserve is not None else kind.reserve(1 if gpus * nodes > 1 else 0),
        gpu_kind=kind.name,
        activations=activations, rows=tuple(rows), recommendation=key, checkpoint=checkpoint,
        reason=reason, network=network,
        call=(None if key is None else strategies[key].call(precision, checkpoint) if base is None
              else from_pretrained_call(strategies[key], base.format, precision, checkpoint)),
        unavailable=unavailable, assumptions=assumptions, fed=fed,
    )


def _tensor_parallel_styles(model: nn.Module, tp_plan: dict[str, str] | None,
                            network: Network) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """The tensor-parallel styles of ``model`` (`tp_styles`) when some weighed layout
    uses tensor parallelism (several nodes of several GPUs), and the layouts left out
    with the reason. Styles are resolved only then: a model whose ``_tp_plan`` asks for
    what annot does not apply (Qwen3's ``replicated_with_grad_allreduce`` norms, MoE
    experts) still gets every other row; its tensor-parallel row says why it is missing."""
    tp_layouts = [s for s in layout_strategies(network.gpus_per_node, network.nodes)
                  if dict(s.mesh).get("tp", 1) > 1]
    if not tp_layouts:
        return {}, ()
    try:
        styles = tp_styles(model, tp_plan)
    except MemoryInputError as error:
        return {}, tuple((s.label, str(error)) for s in tp_layouts)
    if not styles:
        return {}, tuple((s.label, "no Linear layer to split (no _tp_plan, no layer named like "
                          "q_proj/o_proj or c_attn/c_proj): pass tp_plan=") for s in tp_layouts)
    return styles, ()


#: Said under the table of a mixture-of-experts model traced without reading a value.
MOE_COUNTED = (
    "mixture of experts: the trace read no routing value, so the experts' activations it "
    "counted are the same whichever experts the tokens choose (no capacity factor: "
    "transformers' experts drop no token)")


def _speed_said(plan: Plan, network: Network) -> list[str]:
    """What the rows assume of the Plan's float8 and compile units."""
    said = []
    if plan.paths(Action.FLOAT8):
        said.append(
            f"float8: the float8 linears traced as torchao runs them (casts, scales, saved inputs "
            f"counted); their matmuls timed at {network.float8_speedup:g}x the bf16 rate (the GPU's "
            "dense float8/bf16 peak ratio; torchtitan measures 1.28x end to end on Llama 3.1 8B, "
            "the casts taking the rest)")
    if plan.paths(Action.COMPILE):
        said.append("compiled units priced as eager (memory and time): the trace runs eager "
                    "operators; a compiled block's partitioner usually saves less for backward")
    return said


def _states(model: nn.Module, plan: Plan, quantized: QuantizedBase | None
            ) -> tuple[ModelFacts, tuple[ParamRecord, ...]]:
    """What every strategy's memory and step time are computed from: the model's facts
    and its parameters' records, a quantized base's weights in their stored bytes."""
    if quantized is None:
        return model_facts(model, plan), param_records(model, plan)
    return (model_facts(model, plan, **quantized.facts_options()),
            param_records(model, plan, quantized.weights, quantized.costs.stored))


def _rows(model: nn.Module, plan: Plan, *, network: Network, batch: int, seq: int,
          precision: str, optimizer: str, gpu_mem: int, host_mem: int, margin: float,
          reserve: int | None, inputs: InputsFn | None, styles: dict[str, str],
          keys: tuple[str, ...] | None = None, cp: tuple[int, ...] = (),
          cp_attention: str = "allgather",
          user_ds: UserDeepSpeed | None = None, ddp: Strategy | None = None,
          kind: GpuKind | None = None, quantized: QuantizedBase | None = None,
          ) -> tuple[list[StrategyRow], ActivationEstimate, dict[str, Strategy], tuple[str, ...]]:
    gpus, world = network.gpus_per_node, network.world
    if quantized is not None:
        keys = tuple(key for key in (keys or QUANTIZED_KEYS) if key in QUANTIZED_KEYS)
    half = torch.float16 if precision == "fp16-mixed" else torch.bfloat16
    with dequantization_in_trace(model, quantized):
        activations = fast_trace_activations(model, plan, batch=batch, seq=seq,
                                             dtype=None if precision in ("fp32", "amp") else half,
                                             inputs=inputs)
    facts, records = _states(model, plan, quantized)
    candidates = (*(ddp if ddp is not None and s.key == "ddp" else s for s in STRATEGIES),
                  *layout_strategies(gpus, network.nodes, tp=bool(styles)),
                  *cp_strategies(cp, gpus, world, cp_attention),
                  *((user_ds.strategy,) if user_ds is not None else ()))
    chosen = [s for s in candidates if keys is None or s.key in keys]
    attention = attention_shape(model) if cp else None
    # A cp row is traced at the sequence one rank holds.
    seqs = {s.key: seq // dict(s.mesh).get("cp", 1) for s in chosen}
    for c in cp:
        if seq % (2 * c):
            raise MemoryInputError(f"cp={c}: seq {seq} is not a multiple of {2 * c} (each sequence "
                                   f"is split into {2 * c} equal chunks)")

    def precision_of(s: Strategy) -> str:
        return user_ds.precision if user_ds is not None and s.key == USER_DEEPSPEED_KEY else precision

    def facts_of(s: Strategy) -> ModelFacts:
        if user_ds is not None and s.key == USER_DEEPSPEED_KEY:
            return model_facts(model, plan, int(user_ds.zero["stage3_param_persistence_threshold"]))
        return facts
    # With no unit to checkpoint, the checkpointed step is the plain one: traced once.
    can_checkpoint = bool(plan.paths(Action.CHECKPOINT))
    traces: dict[tuple[Any, ...], StepTrace] = {}

    def trace_of(s: Strategy, checkpoint: bool) -> StepTrace:
        """The step ``s`` runs, traced once per setting that changes it: the compute
        dtypes, checkpointing, the sequence a rank holds, whether FSDP2 gathers float8."""
        dtype, autocast = _trace_setting(s, precision_of(s))
        float8_gathered = facts_of(s).gathers_float8(s.engine)
        key = (dtype, autocast, checkpoint, seqs[s.key], float8_gathered)
        if key not in traces:
            # The target is a GPU: autocast casts by CUDA's op lists.
            with dequantization_in_trace(model, quantized):
                traces[key] = fast_trace_step(
                    model, plan, batch=batch, seq=seqs[s.key], checkpoint=checkpoint, dtype=dtype,
                    autocast=autocast, inputs=inputs, gpu_rules=True, float8_gathered=float8_gathered)
        return traces[key]
    rows = []
    for s in chosen:
        zero = user_ds.zero if user_ds is not None and s.key == USER_DEEPSPEED_KEY else None
        plain, ckpt = (strategy_memory(s, trace_of(s, c), facts_of(s), plan,
                                       world=world, precision=precision_of(s), optimizer=optimizer,
                                       records=records, styles=styles, attention=attention,
                                       ds_zero=zero)
                       for c in (False, can_checkpoint))
        times = [step_time(s, trace_of(s, c), plan, model, records, network,
                           precision=precision_of(s), optimizer=optimizer, styles=styles,
                           attention=attention)
                 for c in (False, can_checkpoint)]
        nvme = s.option("offload") == "nvme"
        host = max(plain.host, ckpt.host) * gpus  # every rank of a node offloads to its host
        host_ok = nvme or host <= host_mem

        held = reserve if reserve is not None else (kind or GPU_KINDS[DEFAULT_GPU]).reserve(
            communicators(s, world))

        def fits(m: RankMemory, host_ok: bool = host_ok, held: int = held) -> bool:
            return m.device * (1 + margin) + held <= gpu_mem and host_ok

        call = (s.call(precision, None) if zero is None else
                'annot.auto_wrap(model, "deepspeed", config=your_config, optimizer=make_optimizer)')
        rows.append(StrategyRow(
            key=s.key, label=s.label, call=call, gpu=plain.device,
            gpu_checkpointed=ckpt.device, host=0 if nvme else host, nvme=host if nvme else 0,
            fits=fits(plain), fits_checkpointed=fits(ckpt), detail=plain, detail_checkpointed=ckpt,
            time=times[0], time_checkpointed=times[1],
        ))
    said = [activations.assumption, *(t.assumption for t in traces.values()), *_speed_said(plan, network)]
    assumptions = tuple(dict.fromkeys(text for text in said if text))
    if plan.moe and not assumptions:
        assumptions = (MOE_COUNTED,)
    return rows, activations, {s.key: s for s in chosen}, assumptions


def _preference(cp: tuple[int, ...]) -> tuple[tuple[str, bool], ...]:
    """`PREFERENCE` with the cp rows (smallest cp first) after the strategies that keep
    model states on the GPU, before offload: splitting the sequence costs collectives
    inside a node, moving states off the GPU costs host transfers every step."""
    at = PREFERENCE.index(("zero2-offload", True))
    rows = tuple((f"fsdp2-cp{c}", ckpt) for ckpt in (False, True) for c in sorted(cp))
    return PREFERENCE[:at] + rows + PREFERENCE[at:]


def _recommend(
    rows: list[StrategyRow], params: int, gpu_mem: int, can_checkpoint: bool,
    cp: tuple[int, ...] = (),
) -> tuple[str | None, bool | None, str]:
    by_key = {r.key: r for r in rows}
    for key, checkpoint in _preference(cp):
        if checkpoint and not can_checkpoint or key not in by_key:
            continue
        row = by_key[key]
        if not (row.fits_checkpointed if checkpoint else row.fits):
            continue
        if key == "ddp" and params >= DDP_LIMIT_PARAMS:
            continue  # fits, but replicating optimizer states wastes memory at this size
        how = "with checkpointing" if checkpoint else "without checkpointing"
        need = row.gpu_checkpointed if checkpoint else row.gpu
        why = {
            "ddp": f"below ~{format_count(DDP_LIMIT_PARAMS)} parameters and it fits: no sharding overhead",
            "zero1": "sharding optimizer states is enough and costs no extra communication",
            "zero2": "sharding gradients and optimizer states is enough; no parameter all-gathers",
            "fsdp2-no-reshard": "parameters must be sharded; kept gathered from forward to backward",
            "fsdp2": "parameters must be sharded too (ZeRO-3-like)",
            "zero3": "parameters must be sharded too",
        }.get(key, "the sequence must be split over ranks: no strategy without context parallelism "
                   "fits" if key.startswith("fsdp2-cp") else
                   "it does not fit on the GPUs without moving model states off them")
        return key, checkpoint, (
            f"{row.label} {how}: {format_bytes(need)} counted of {format_bytes(gpu_mem)} per GPU; {why}"
        )
    return None, None, (
        f"nothing fits {format_bytes(gpu_mem)} per GPU: use more GPUs (--gpus/--nodes), "
        "a smaller --batch or --seq, or more host memory for offload"
    )


#: Why each two-dimensional layout sends less across nodes (`_prefer_network`).
_LAYOUT_WHY = {
    "fsdp2-hsdp": "parameters are gathered and gradients reduce-scattered inside each node; "
                  "only the all-reduce of each GPU's gradient shard crosses nodes",
    "fsdp1-hybrid": "parameters are gathered and gradients reduce-scattered inside each node; "
                    "only the all-reduce of each GPU's gradient shard crosses nodes",
    "zero3-hpz": "the backward all-gather reads a copy sharded inside the node; the forward "
                 "all-gather and the reduce-scatter still cross nodes",
    "tp-fsdp2": "tensor parallelism's activation all-reduces stay inside the node and FSDP2 "
                "sends 1/tp of the parameters across nodes",
}


def _prefer_network(rows: list[StrategyRow], key: str, checkpoint: bool | None,
                    reason: str) -> tuple[str, bool | None, str]:
    """On several nodes: when the recommended strategy's step is bound by the inter-node
    link (its collectives crossing nodes take longer than its compute), the fastest
    two-dimensional layout that fits and trains more tokens per second instead."""
    by_key = {r.key: r for r in rows}
    chosen = by_key[key]
    t = chosen.time_checkpointed if checkpoint else chosen.time
    if t is None or t.comm.inter_seconds <= t.compute:
        return key, checkpoint, reason
    best: tuple[float, str, bool] | None = None
    for r in rows:
        if r.key not in _LAYOUT_WHY:
            continue
        for ckpt, fits, time in ((False, r.fits, r.time), (True, r.fits_checkpointed, r.time_checkpointed)):
            # Faster by more than 1%: a tie keeps the earlier row (FSDP2 before FSDP1).
            if fits and time is not None and time.tokens_per_second > t.tokens_per_second and (
                    best is None or time.tokens_per_second > 1.01 * best[0]):
                best = (time.tokens_per_second, r.key, ckpt)
    if best is None:
        return key, checkpoint, reason + (
            f"; the inter-node link binds its step ({_seconds(t.comm.inter_seconds)} across nodes "
            f"against {_seconds(t.compute)} compute) and no two-dimensional layout that fits is faster")
    row = by_key[best[1]]
    new = row.time_checkpointed if best[2] else row.time
    assert new is not None
    return best[1], best[2], (
        f"{row.label} {'with' if best[2] else 'without'} checkpointing: the inter-node link binds "
        f"{chosen.label} ({_seconds(t.comm.inter_seconds)} of its step crosses nodes against "
        f"{_seconds(t.compute)} compute); {_LAYOUT_WHY[row.key]}: step {_seconds(new.overlapped)} "
        f"instead of {_seconds(t.overlapped)}"
    )
