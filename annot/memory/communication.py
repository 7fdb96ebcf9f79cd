"""What each rank sends over the network in one training step, and what it costs.

For every strategy and rank layout the planner weighs, `step_communication` lists the
collectives the engine runs in one step (forward, backward, optimizer step), each with
its group (a dimension of the layout) and the size of the whole tensor it moves, then
splits the bytes a rank sends into traffic inside its node and across nodes, and turns
them into seconds with the link bandwidths of a `Network`.

**Byte counts** are the ring algorithm's (NCCL's for large messages). For a tensor of
``S`` bytes over a group of ``n`` ranks each rank sends

- all-gather (``S`` is the gathered output): ``(n-1)/n * S``;
- reduce-scatter (``S`` is the full input): ``(n-1)/n * S``;
- all-reduce: ``2(n-1)/n * S`` (a reduce-scatter and an all-gather);
- all-to-all (``S`` is one rank's input, Ulysses' exchange over the cp group):
  ``(n-1)/n * S`` (it keeps its own block).

**Placement.** Ranks are numbered ``rank = (r * shard + s) * tp + t`` over the layout
``replicate x shard x tp`` (tp innermost, on consecutive ranks, so inside a node;
replicate outermost), and consecutive ranks share a node (``gpus_per_node`` of them).
A group whose ``n`` ranks lie on ``m`` nodes runs a ring ordered node by node: ``m`` of
its ``n`` links cross nodes (none when ``m`` is 1). So of the ``V`` bytes each rank
sends, ``V * m/n`` cross nodes on average over the node's ranks (``inter``) and the rest
stay inside (``intra``); a node sends ``gpus_per_node * inter`` bytes to the others.

**Time.** Every link of a ring carries ``V``. Inside a node each GPU sends at
``intra_node_bw``; across nodes all groups with ranks on a node share its
``inter_node_bw`` (the node's network bandwidth, every NIC together). A collective takes
``max(V / intra_node_bw, node's outgoing bytes / inter_node_bw)``; the collectives of a
step run one after another. Compute takes the traced step's FLOPs at ``tflops`` per GPU.
``step_overlapped = max(compute, comm)`` assumes the engine hides every collective behind
compute (prefetching, bucketed reduction); ``step_serial = compute + comm`` assumes it
hides none. Real runs land in between; both are reported. Latency, PCIe traffic of
offload, and NCCL's tree algorithms are not modelled.

**What each engine sends** (read in torch 2.13 and DeepSpeed 0.19 and, for FSDP2, HSDP
and tensor parallelism, counted against the real collectives under torch's fake process
group: tests/memory/test_comm_simulated.py):

- DDP: an all-reduce of every trainable gradient (gradient dtype; bucketing does not
  change the total).
- FSDP2 (``fully_shard``): per unit, an all-gather of its parameters in the compute dtype
  (each parameter's shard padded to ``ceil(dim0/n)`` rows) in forward and, with
  ``reshard_after_forward``, again in backward; the root (annot leaves it to FSDP2's
  default) is gathered once. A reduce-scatter of the unit's gradients in the reduce dtype
  (fp32 with annot's mixed precision). HSDP (a 2-D mesh): gathers and reduce-scatters
  over ``shard``, then an all-reduce of the shard-sized gradient over ``replicate``.
- FSDP1: the same per unit with one flat parameter padded to a multiple of ``n``
  (``FULL_SHARD``; ``SHARD_GRAD_OP`` gathers once; the root is not resharded after
  forward). ``HYBRID_SHARD``: as HSDP.
- DeepSpeed ZeRO-1/2: an all-reduce of the gradients (``use_multi_rank_bucket_allreduce``,
  DeepSpeed 0.19's default: every bucket is all-reduced, each rank keeps its partition)
  in the communication dtype (fp16/bf16 in 16-bit modes), then an all-gather of the
  updated parameters after the optimizer step.
- DeepSpeed ZeRO-3: an all-gather of each parameter above the persistence threshold in
  forward and again in backward, a reduce-scatter of the gradients (each parameter
  padded to a multiple of ``n``), and an all-gather of the persistent parameters after
  the step. DeepSpeed keeps a parameter gathered when it recurs within
  ``stage3_max_reuse_distance`` elements; annot writes one unit, which spares at most the
  end of forward from the backward gather, so the backward figure is an upper bound by at
  most one unit. With hpZ (``zero_hpz_partition_size=h``) the forward gather and the
  reduce-scatter span every rank while the backward gather reads a secondary partition
  inside groups of ``h`` consecutive ranks.
- Tensor parallelism (torch's ``parallelize_module``): a column-wise Linear all-reduces
  its input's gradient in backward; a row-wise Linear all-reduces its output in forward;
  ``colwise_gather_output`` all-gathers its output in forward; ``embedding_rowwise``
  all-reduces its output in forward; ``rowwise_split_input`` all-gathers its input's
  gradient in backward. Activations move in the compute dtype, and a checkpointed unit
  repeats its forward collectives when it is recomputed. FSDP2 then shards each rank's
  tensor-parallel shard over ``shard``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from torch import nn

from annot.memory.strategies import MemoryInputError, Strategy

__all__ = [
    "INTER_NODE_BW",
    "INTRA_NODE_BW",
    "TFLOPS",
    "Collective",
    "Layout",
    "Network",
    "Dtypes",
    "ParamRecord",
    "StepCommunication",
    "local_numel",
    "param_records",
    "ring_bytes",
    "step_collectives",
    "step_communication",
    "strategy_layout",
    "tp_styles",
]

#: Defaults, stated: NVLink-class bandwidth each GPU sends inside a node (GB/s), a node's
#: network bandwidth to the others (GB/s: one 200 Gb/s NIC), and sustained dense
#: throughput per GPU (TFLOP/s: an A100 at about half its 312 bf16 peak).
INTRA_NODE_BW = 150.0
INTER_NODE_BW = 25.0
TFLOPS = 150.0

OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
DIMS = ("world", "replicate", "shard", "cp", "tp")


def ring_bytes(op: str, size: float, ranks: int) -> float:
    """Bytes each of ``ranks`` sends for ``op`` on a ``size``-byte tensor (module docstring)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    if ranks <= 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if op == "all-reduce" else (ranks - 1) / ranks
    return factor * size


@dataclasses.dataclass(frozen=True)
class Network:
    """The machines: GPUs per node, nodes, each GPU's bandwidth inside its node and each
    node's bandwidth to the others (bytes/s, one direction), each GPU's sustained
    FLOP/s, and its float8 matmuls' speedup over that."""

    gpus_per_node: int
    nodes: int = 1
    intra_node_bw: float = INTRA_NODE_BW * 1e9
    inter_node_bw: float = INTER_NODE_BW * 1e9
    flops: float = TFLOPS * 1e12
    #: How much faster a float8 matmul runs than a bf16 one (the GPU's dense peak ratio:
    #: 2 on Hopper, 1 where there is no float8 matmul).
    float8_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise MemoryInputError("GPUs per node and nodes must be at least 1")
        for name in ("intra_node_bw", "inter_node_bw", "flops", "float8_speedup"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise MemoryInputError(f"{name} must be a positive number, got {value!r}")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Ranks as ``replicate x shard x cp x tp`` (tp innermost, replicate outermost)."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    #: Context parallel: ranks splitting one sequence (FSDP2 shards over shard x cp).
    cp: int = 1

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.cp * self.tp

    def flattened(self) -> Layout:
        """The layout FSDP2 shards over: ``shard x cp`` as one shard dimension."""
        return dataclasses.replace(self, shard=self.shard * self.cp, cp=1)

    def group(self, dim: str) -> tuple[int, int]:
        """(ranks, stride between consecutive members) of one group along ``dim``."""
        if dim == "world":
            return self.world, 1
        if dim == "tp":
            return self.tp, 1
        if dim == "cp":
            return self.cp, self.tp
        if dim == "shard":
            return self.shard, self.cp * self.tp
        if dim == "replicate":
            return self.replicate, self.shard * self.cp * self.tp
        raise ValueError(f"unknown layout dimension {dim!r}; one of {', '.join(DIMS)}")

    def span(self, dim: str, gpus_per_node: int) -> tuple[int, int]:
        """(ranks of rank 0's group along ``dim`` on each node it touches, nodes it
        touches)."""
        ranks, stride = self.group(dim)
        nodes = len({i * stride // gpus_per_node for i in range(ranks)})
        return ranks // nodes, nodes


def strategy_layout(strategy: Strategy, world: int) -> Layout:
    """The layout ``strategy`` runs on ``world`` ranks: its mesh's dimensions, the hpZ
    groups of ``hpz_partition_size`` consecutive ranks (ZeRO-3 still partitions over
    every rank), else one dimension over every rank."""
    sizes = dict(strategy.mesh)
    hpz = int(strategy.option("hpz_partition_size", 1))
    if hpz > 1:
        return Layout(replicate=world // hpz, shard=hpz)
    if not sizes:
        return Layout(shard=world)
    return Layout(replicate=sizes.get("replicate", 1), shard=sizes.get("shard", 1),
                  tp=sizes.get("tp", 1), cp=sizes.get("cp", 1))


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: ``op`` over the group along ``dim``
    (``ranks``), moving tensors of ``size`` bytes in all (summed over its calls; the
    all-gathered output, the reduce-scattered input, the all-reduced tensor, one rank's
    all-to-all input)."""

    op: str
    what: str
    dim: str
    ranks: int
    size: int

    @property
    def sent(self) -> float:
        """Bytes each rank sends (`ring_bytes`)."""
        return ring_bytes(self.op, self.size, self.ranks)


@dataclasses.dataclass(frozen=True)
class StepCommunication:
    """A step's collectives and what they cost one rank: bytes it sends inside its
    node (``intra``) and across nodes (``inter``, averaged over the node's ranks), and the
    seconds the network needs if the collectives run one after another."""

    collectives: tuple[Collective, ...]
    intra: int
    inter: int
    seconds: float
    #: The part of ``seconds`` spent in collectives the inter-node link binds.
    inter_seconds: float = 0.0

    @property
    def sent(self) -> int:
        return self.intra + self.inter

    def by_op(self) -> dict[str, int]:
        """Bytes each rank sends per step, by collective."""
        totals = dict.fromkeys(OPS, 0.0)
        for c in self.collectives:
            totals[c.op] += c.sent
        return {op: round(v) for op, v in totals.items()}


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One parameter (shared ones once): the shard unit holding it (index into the
    Plan's shard units, -1 the root), its module's path, its name there, its shape,
    whether it trains."""

    unit: int
    module: str
    name: str
    shape: tuple[int, ...]
    trainable: bool
    #: Bytes an element is stored and gathered in when that is not the compute dtype's:
    #: a quantized weight (QLoRA's NF4, `annot.memory.quantized_base`); ``None`` otherwise.
    stored: float | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_records(model: nn.Module, plan: Any, quantized: Collection[int] = (),
                  stored: float | None = None) -> tuple[ParamRecord, ...]:
    """`ParamRecord` of every parameter of ``model`` (meta is fine) under ``plan``;
    ``quantized``: ids of the parameters a quantized base holds in ``stored`` bytes an
    element."""
    from annot.policies import Action

    owner: dict[int, int] = {}
    for index, unit in enumerate(u for u in plan.units if u.has(Action.SHARD)):
        for path in unit.modules:
            for p in model.get_submodule(path).parameters():
                owner.setdefault(id(p), index)
    seen: set[int] = set()
    records = []
    for module_path, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            records.append(ParamRecord(owner.get(id(p), -1), module_path, name, tuple(p.shape),
                                       p.requires_grad, stored if id(p) in quantized else None))
    return tuple(records)


#: For a model that carries no tensor-parallel plan: Linear layers split column-wise or
#: row-wise by the last component of their path (Llama/Mistral/Qwen and GPT-2/minGPT
#: names).
_COLWISE_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")
_ROWWISE_NAMES = ("o_proj", "down_proj", "c_proj")


def tp_styles(model: nn.Module, plan: Mapping[str, str] | None = None) -> dict[str, str]:
    """Module path -> tensor-parallel style, as the engine would split ``model``
    (`annot.policies.tensor_parallel.resolve_tp_plan`). ``plan``: module-path patterns as
    transformers' ``_tp_plan``; default the model's own ``_tp_plan``, else a `tp_rule` over
    the Linear layers named like Llama/Mistral/Qwen's and GPT-2/minGPT's (``q_proj``/
    ``c_attn``/... column-wise, ``o_proj``/``down_proj``/``c_proj`` row-wise). Empty:
    nothing to split."""
    from annot.policies.errors import PlanError
    from annot.policies.tensor_parallel import model_tp_plan, resolve_tp_plan, tp_rule

    source: Any = plan
    if plan is None and model_tp_plan(model) is None:
        names = {path.rsplit(".", 1)[-1] for path, m in model.named_modules() if isinstance(m, nn.Linear)}
        colwise = [n for n in _COLWISE_NAMES if n in names]
        rowwise = [n for n in _ROWWISE_NAMES if n in names]
        if not colwise and not rowwise:
            return {}
        source = tp_rule(colwise=colwise, rowwise=rowwise)
    try:
        return resolve_tp_plan(model, source)
    except PlanError as error:
        raise MemoryInputError(str(error)) from None


def _local_shape(record: ParamRecord, style: str | None, tp: int) -> tuple[int, ...]:
    """The shape rank 0 holds of ``record`` after tensor parallelism (torch's Shard
    placements give the first ranks ``ceil``)."""
    shape = list(record.shape) or [1]
    if tp == 1 or style in (None, "replicate"):
        return tuple(shape)
    column = style in ("colwise", "colwise_gather_output", "colwise_rep")
    row = style in ("rowwise", "rowwise_split_input", "rowwise_rep")
    if column or style == "embedding_rowwise":
        shape[0] = -(-shape[0] // tp)  # weight rows (output features), bias
    elif (row or style == "embedding_colwise") and len(shape) > 1:
        shape[1] = -(-shape[1] // tp)  # weight columns; a row-wise bias stays whole
    return tuple(shape)


def local_numel(record: ParamRecord, style: str | None, tp: int) -> int:
    """Elements of ``record`` one tensor-parallel rank holds (``style`` its module's)."""
    return math.prod(_local_shape(record, style, tp))


def _dim0_padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of a parameter's FSDP2 shard, padded: ``ceil(dim0/n)`` rows."""
    rows = shape[0] if shape else 1
    return -(-rows // n) * (math.prod(shape) // max(rows, 1) if shape else 1)


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """Bytes per element as each collective moves them: ``gather`` (parameters),
    ``reduce`` (gradients), ``activation`` (tensor-parallel activations)."""

    gather: int
    reduce: int
    activation: int


def _by_unit(records: Iterable[ParamRecord]) -> dict[int, list[ParamRecord]]:
    units: dict[int, list[ParamRecord]] = {}
    for r in records:
        units.setdefault(r.unit, []).append(r)
    return units


def _fsdp(records: tuple[ParamRecord, ...], layout: Layout, dt: Dtypes, reshard: bool,
          shards: Callable[[list[ParamRecord]], tuple[int, int]]) -> list[Collective]:
    """FSDP's collectives (FSDP2 and FSDP1 alike): ``shards`` gives a unit's elements per
    rank, gathered and reduced (padding included)."""
    n = layout.shard
    fwd = bwd = rs = ar = 0
    for unit, params in _by_unit(records).items():
        shard, grads = shards(params)
        # A quantized weight is gathered in its packed bytes (it splits evenly: no padding).
        packed = sum(r.numel * (r.stored - dt.gather) for r in params if r.stored is not None)
        gathered = n * shard * dt.gather + round(packed)
        fwd += gathered
        if reshard and unit >= 0:  # neither FSDP reshards the root after forward
            bwd += gathered
        rs += n * grads * dt.reduce
        ar += grads * dt.reduce
    found = [Collective("all-gather", "parameters, forward", "shard", n, fwd),
             Collective("all-gather", "parameters, backward", "shard", n, bwd),
             Collective("reduce-scatter", "gradients", "shard", n, rs)]
    if layout.replicate > 1:
        found.append(Collective("all-reduce", "gradient shards", "replicate", layout.replicate, ar))
    return found


def _fsdp2_shards(layout: Layout, styles: Mapping[str, str]) -> Callable[[list[ParamRecord]], tuple[int, int]]:
    """FSDP2: each parameter (its tensor-parallel piece) sharded on dim 0, padded to
    ``ceil(dim0/n)`` rows; only parameters that train are reduced."""
    def shards(params: list[ParamRecord]) -> tuple[int, int]:
        sizes = [(_dim0_padded(_local_shape(r, styles.get(r.module), layout.tp), layout.shard), r.trainable)
                 for r in params]
        return sum(s for s, _ in sizes), sum(s for s, trains in sizes if trains)
    return shards


def _fsdp1_shards(layout: Layout) -> Callable[[list[ParamRecord]], tuple[int, int]]:
    """FSDP1: one flat parameter per unit padded to a multiple of ``n``, its whole
    gradient reduced when anything in it trains."""
    def shards(params: list[ParamRecord]) -> tuple[int, int]:
        shard = -(-sum(r.numel for r in params) // layout.shard)
        return shard, shard if any(r.trainable for r in params) else 0
    return shards


def _zero(records: tuple[ParamRecord, ...], layout: Layout, dt: Dtypes, stage: int,
          persistence_threshold: int, hpz: int) -> list[Collective]:
    n = layout.world
    trainable = [r for r in records if r.trainable]
    if stage in (1, 2):
        grads = sum(r.numel for r in trainable)
        return [Collective("all-reduce", "gradients", "world", n, grads * dt.reduce),
                Collective("all-gather", "updated parameters, after the step", "world", n,
                           -(-grads // n) * n * dt.gather)]
    padded = {id(r): -(-r.numel // n) * n for r in records}
    gathered = sum(padded[id(r)] for r in records if r.numel > persistence_threshold) * dt.gather
    persistent = sum(padded[id(r)] for r in records if r.numel <= persistence_threshold) * dt.gather
    found = [Collective("all-gather", "parameters, forward", "world", n, gathered)]
    if hpz > 1:
        found.append(Collective("all-gather", "parameters, backward (hpZ secondary partition)",
                                "shard", hpz, gathered))
    else:
        found.append(Collective("all-gather", "parameters, backward", "world", n, gathered))
    found += [Collective("reduce-scatter", "gradients", "world", n,
                         sum(padded[id(r)] for r in trainable) * dt.reduce),
              Collective("all-gather", "persistent parameters, after the step", "world", n, persistent)]
    return found


def _tp_activations(model: nn.Module, styles: Mapping[str, str], layout: Layout, dt: Dtypes,
                    tokens: int, recomputed: set[str]) -> list[Collective]:
    """Tensor parallelism's activation collectives (module docstring), ``tokens`` per
    rank's micro-batch; modules under a path in ``recomputed`` repeat their forward ones."""
    forward = {"all-reduce": 0, "all-gather": 0}
    backward = {"all-reduce": 0, "all-gather": 0}
    for path, style in styles.items():
        module = model.get_submodule(path)
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            raise MemoryInputError(f"tensor-parallel style {style!r} on {path!r} "
                                   f"({type(module).__name__}): not a Linear or Embedding")
        if isinstance(module, nn.Embedding):
            width_in, width_out = 0, weight.shape[1]
        else:
            width_out, width_in = weight.shape
        times = 1 + any(path == p or path.startswith(p + ".") or p == "" for p in recomputed)
        out = tokens * width_out * dt.activation
        grad_in = tokens * width_in * dt.activation
        if style in ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
            forward["all-reduce"] += out * times
        if style in ("colwise_gather_output", "colwise_rep", "embedding_colwise"):
            forward["all-gather"] += out * times
        if style in ("colwise", "colwise_gather_output", "colwise_rep"):
            backward["all-reduce"] += grad_in
        if style in ("rowwise_split_input", "rowwise_rep"):
            backward["all-gather"] += grad_in
    return [Collective(op, f"activations, {phase}", "tp", layout.tp, size)
            for phase, sizes in (("forward", forward), ("backward", backward))
            for op, size in sizes.items() if size]


def step_collectives(engine: str, *, stage: int, records: tuple[ParamRecord, ...], layout: Layout,
                     dtypes: Dtypes, hpz: int = 1, persistence_threshold: int = 0,
                     tp: tuple[nn.Module, Mapping[str, str], int, set[str]] | None = None,
                     ) -> list[Collective]:
    """The collectives of one training step of ``engine`` (``ddp``, ``fsdp1``, ``fsdp2``,
    ``deepspeed``) at ZeRO-equivalent ``stage`` (3: parameters resharded after forward)
    over ``layout``. ``tp``: (model, module path -> style, tokens per micro-batch,
    checkpointed paths) when ``layout.tp > 1`` (FSDP2 only)."""
    styles = tp[1] if tp is not None else {}
    if layout.tp > 1 and (engine != "fsdp2" or tp is None):
        raise MemoryInputError("tensor parallelism is modelled with FSDP2 only, given its styles")
    if engine == "ddp":
        grads = sum(r.numel for r in records if r.trainable)
        found = [Collective("all-reduce", "gradients", "world", layout.world, grads * dtypes.reduce)]
    elif engine == "fsdp2":
        found = _fsdp(records, layout, dtypes, stage == 3, _fsdp2_shards(layout, styles))
    elif engine == "fsdp1":
        found = _fsdp(records, layout, dtypes, stage == 3, _fsdp1_shards(layout))
    elif engine == "deepspeed":
        found = _zero(records, layout, dtypes, stage, persistence_threshold, hpz)
    else:
        raise MemoryInputError(f"no communication model for engine {engine!r}")
    if tp is not None and layout.tp > 1:
        found += _tp_activations(tp[0], styles, layout, dtypes, tp[2], tp[3])
    return [c for c in found if c.size and c.ranks > 1]


def step_communication(collectives: Iterable[Collective], layout: Layout,
                       network: Network) -> StepCommunication:
    """Bytes per rank inside and across nodes, and the network's seconds (module
    docstring), of ``collectives`` over ``layout`` on ``network``."""
    if layout.world != network.world:
        raise MemoryInputError(
            f"the layout {layout.replicate} x {layout.shard} x {layout.cp} x {layout.tp} "
            "(replicate x shard x cp x tp) "
            f"has {layout.world} ranks, the machines {network.world} "
            f"({network.nodes} x {network.gpus_per_node})")
    intra = inter = seconds = inter_seconds = 0.0
    g = network.gpus_per_node
    collectives = tuple(collectives)
    for c in collectives:
        per_node, nodes = layout.span(c.dim, g)
        sent = c.sent
        crossing = sent * nodes / c.ranks if nodes > 1 else 0.0
        intra += sent - crossing
        inter += crossing
        inside = sent / network.intra_node_bw if per_node > 1 else 0.0
        outside = g * crossing / network.inter_node_bw
        seconds += max(inside, outside)
        if outside > inside:
            inter_seconds += outside
    return StepCommunication(collectives, round(intra), round(inter), seconds, inter_seconds)
