"""`estimate_memory`: per-rank memory of every strategy, whether each fits, and the
fastest one that does, written as the `annot.auto_wrap` call that builds it."""

from __future__ import annotations

import dataclasses
import os
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
from annot.memory.engine_memory import OPTIMIZERS, ModelFacts, RankMemory, model_facts, rank_memory
from annot.memory.strategies import PRECISIONS, STRATEGIES, MemoryInputError, Strategy, strategy
from annot.policies import Action, Plan, Policy, Rule, make_plan
from annot.policies.plan import format_bytes
from annot.policies.rules import format_count

__all__ = ["MARGIN", "RESERVE", "MemoryReport", "StrategyRow", "estimate_memory"]

GiB = 2**30
DDP_LIMIT_PARAMS = 500_000_000  # the seeds' rule of thumb: DDP below about 500M parameters
#: What no count sees, added to every counted GPU peak before comparing with the GPU's
#: memory: ``MARGIN`` of the peak (the caching allocator's rounding and fragmentation)
#: plus ``RESERVE`` bytes (the CUDA context, NCCL's buffers and workspaces). Counted CPU
#: runs verify the counted part only (tests/memory/test_counted.py); these two are
#: stated allowances, configurable per call (``margin=``, ``reserve=``).
MARGIN = 0.10
RESERVE = 1 * GiB
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

    def row(self, key: str) -> StrategyRow:
        return next(r for r in self.rows if r.key == key)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def table(self) -> str:
        header = ("strategy", "GPU peak", "GPU w/ ckpt", "host/node", "NVMe/node", "fits")
        rows = []
        for r in self.rows:
            fits = ("yes" if r.fits else "ckpt" if r.fits_checkpointed else "no")
            mark = " <-" if r.key == self.recommendation else ""
            rows.append((r.label, format_bytes(r.gpu), format_bytes(r.gpu_checkpointed),
                         format_bytes(r.host), format_bytes(r.nvme) if r.nvme else "-", fits + mark))
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
            f"+ {format_bytes(self.reserve)} must fit), {format_bytes(self.host_mem)} per host",
        ]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        lines.append(f"recommendation: {self.reason}")
        if self.recommendation is not None:
            lines.append(f"  {strategy(self.recommendation).call(self.precision, self.checkpoint)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _default_gpu_mem() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return 80 * GiB


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
                    world: int, precision: str, optimizer: str) -> RankMemory:
    """`rank_memory` of ``strategy`` with the config annot writes for it, on ``trace``
    (the training step traced in ``strategy``'s precision setting, `_trace_setting`)."""
    zero = None
    if strategy.engine == "deepspeed":
        from annot.engines.deepspeed_config import deepspeed_config

        options = strategy.engine_options(precision)
        precision_name = options.pop("mixed_precision", None)
        zero = deepspeed_config(plan, precision=precision_name, **options)["zero_optimization"]
    return rank_memory(strategy, trace, facts, world=world, precision=precision,
                       optimizer=optimizer, ds_zero=zero)


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
    reserve: int = RESERVE,
    inputs: InputsFn | None = None,
) -> MemoryReport:
    """Per-GPU and per-host memory of every strategy for ``model`` (build it on the meta
    device: nothing is allocated) and the fastest strategy that fits.

    ``gpus`` is GPUs per node; ``batch`` the micro-batch per GPU; ``gpu_mem``/``host_mem``
    in bytes (defaults: the visible GPU, else 80 GiB; this machine's RAM). ``plan`` may be
    a Plan, or a policy/rule to build one (default: the model's marks / HF metadata); its
    checkpoint units are what "with checkpointing" means. A strategy fits when its
    counted peak x (1 + ``margin``) + ``reserve`` is at most ``gpu_mem``. The optimizer is
    torch's (foreach, as on GPUs).
    """
    wrappers = {"DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"}
    if any(hasattr(p, "device_mesh") for p in model.parameters()) or any(
            k.__name__ in wrappers for k in type(model).__mro__):
        raise MemoryInputError(
            "estimate_memory() takes the bare model (best built on the meta device), not one "
            "already wrapped or sharded by an engine")
    if not isinstance(plan, Plan):
        plan = make_plan(model, plan)
    if precision not in PRECISIONS:
        raise MemoryInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise MemoryInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if gpus < 1 or nodes < 1:
        raise MemoryInputError("--gpus and --nodes must be at least 1")
    gpu_mem = gpu_mem if gpu_mem is not None else _default_gpu_mem()
    host_mem = host_mem if host_mem is not None else _default_host_mem()
    rows, activations = _rows(model, plan, gpus=gpus, nodes=nodes, batch=batch, seq=seq,
                              precision=precision, optimizer=optimizer, gpu_mem=gpu_mem,
                              host_mem=host_mem, margin=margin, reserve=reserve, inputs=inputs)
    key, checkpoint, reason = _recommend(rows, plan.total_params, gpu_mem, bool(activations.per_unit))
    return MemoryReport(
        model=type(model).__name__, params=plan.total_params,
        largest_unit_params=max([u.params for u in plan.units] + [plan.root.params]),
        gpus_per_node=gpus, nodes=nodes, precision=precision, optimizer=optimizer, batch=batch,
        seq=seq, gpu_mem=gpu_mem, host_mem=host_mem, margin=margin, reserve=reserve,
        activations=activations, rows=tuple(rows), recommendation=key, checkpoint=checkpoint,
        reason=reason,
    )


def _rows(model: nn.Module, plan: Plan, *, gpus: int, nodes: int, batch: int, seq: int,
          precision: str, optimizer: str, gpu_mem: int, host_mem: int, margin: float,
          reserve: int, inputs: InputsFn | None,
          keys: tuple[str, ...] | None = None) -> tuple[list[StrategyRow], ActivationEstimate]:
    half = torch.float16 if precision == "fp16-mixed" else torch.bfloat16
    activations = trace_activations(model, plan, batch=batch, seq=seq,
                                    dtype=None if precision in ("fp32", "amp") else half, inputs=inputs)
    facts = model_facts(model, plan)
    chosen = [s for s in STRATEGIES if keys is None or s.key in keys]
    # With no unit to checkpoint, the checkpointed step is the plain one: traced once.
    can_checkpoint = bool(plan.paths(Action.CHECKPOINT))
    traces: dict[tuple[Any, ...], StepTrace] = {}
    for s in chosen:
        dtype, autocast = _trace_setting(s, precision)
        for checkpoint in (False, can_checkpoint):
            if (dtype, autocast, checkpoint) not in traces:
                traces[(dtype, autocast, checkpoint)] = trace_step(
                    model, plan, batch=batch, seq=seq, checkpoint=checkpoint, dtype=dtype,
                    autocast=autocast, inputs=inputs)
    rows = []
    for s in chosen:
        setting = _trace_setting(s, precision)
        plain, ckpt = (strategy_memory(s, traces[(*setting, c)], facts, plan, world=gpus * nodes,
                                       precision=precision, optimizer=optimizer)
                       for c in (False, can_checkpoint))
        nvme = s.option("offload") == "nvme"
        host = max(plain.host, ckpt.host) * gpus  # every rank of a node offloads to its host
        host_ok = nvme or host <= host_mem

        def fits(m: RankMemory, host_ok: bool = host_ok) -> bool:
            return m.device * (1 + margin) + reserve <= gpu_mem and host_ok

        rows.append(StrategyRow(
            key=s.key, label=s.label, call=s.call(precision, None), gpu=plain.device,
            gpu_checkpointed=ckpt.device, host=0 if nvme else host, nvme=host if nvme else 0,
            fits=fits(plain), fits_checkpointed=fits(ckpt), detail=plain, detail_checkpointed=ckpt,
        ))
    return rows, activations


def _recommend(
    rows: list[StrategyRow], params: int, gpu_mem: int, can_checkpoint: bool
) -> tuple[str | None, bool | None, str]:
    by_key = {r.key: r for r in rows}
    for key, checkpoint in PREFERENCE:
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
        }.get(key, "it does not fit on the GPUs without moving model states off them")
        return key, checkpoint, (
            f"{row.label} {how}: {format_bytes(need)} counted of {format_bytes(gpu_mem)} per GPU; {why}"
        )
    return None, None, (
        f"nothing fits {format_bytes(gpu_mem)} per GPU: use more GPUs (--gpus/--nodes), "
        "a smaller --batch or --seq, or more host memory for offload"
    )
