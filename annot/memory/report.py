"""`estimate_memory`: model states and activations per GPU for every strategy, whether
each fits, and the fastest one that does."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from annot.memory.activations import ActivationEstimate, InputsFn, trace_activations
from annot.memory.states import STRATEGIES, BytesPerParam, MemoryInputError, model_states
from annot.policies import Plan, Policy, Rule, make_plan
from annot.policies.plan import format_bytes
from annot.policies.rules import format_count

__all__ = ["MemoryReport", "StrategyRow", "estimate_memory"]

GiB = 2**30
DDP_LIMIT_PARAMS = 500_000_000  # the seeds' rule of thumb: DDP below about 500M parameters
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16,
                 "fp16-mixed": torch.float16, "bf16": torch.bfloat16}
# Fastest first. Checkpointing costs about a third more compute; a ZeRO-3 parameter
# all-gather and especially offload cost more than that.
PREFERENCE: tuple[tuple[str, bool], ...] = (
    ("ddp", False), ("zero1", False), ("zero2", False),
    ("ddp", True), ("zero1", True), ("zero2", True),
    ("fsdp2", False), ("zero3", False), ("fsdp2", True), ("zero3", True),
    ("zero2-offload-opt-cpu", True), ("zero3-offload-opt-cpu", True),
    ("fsdp2-offload-cpu", True), ("zero3-offload-all-cpu", True),
    ("zero3-offload-opt-nvme", True), ("zero3-offload-all-nvme", True),
)


@dataclasses.dataclass(frozen=True)
class StrategyRow:
    """One strategy: model states plus activations, without and with checkpointing."""

    key: str
    label: str
    states_gpu: int
    host: int
    nvme: int
    gpu: int  # states + activations, no checkpointing
    gpu_checkpointed: int  # states + kept activations + one unit's recomputation
    fits: bool
    fits_checkpointed: bool


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Everything `annot plan --memory` prints; `to_dict()` is its ``--json``."""

    model: str
    params: int
    largest_layer_params: int
    largest_unit_params: int
    gpus_per_node: int
    nodes: int
    precision: str
    optimizer: str
    batch: int
    seq: int
    gpu_mem: int
    host_mem: int
    activations: ActivationEstimate
    rows: tuple[StrategyRow, ...]
    recommendation: str | None
    checkpoint: bool | None
    reason: str

    def row(self, key: str) -> StrategyRow:
        return next(r for r in self.rows if r.key == key)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rows"] = [dataclasses.asdict(r) for r in self.rows]
        return data

    def table(self) -> str:
        header = ("strategy", "states/GPU", "GPU total", "GPU w/ ckpt", "host", "NVMe", "fits")
        rows = []
        for r in self.rows:
            fits = ("yes" if r.fits else "ckpt" if r.fits_checkpointed else "no")
            mark = " <-" if r.key == self.recommendation else ""
            rows.append((r.label, format_bytes(r.states_gpu), format_bytes(r.gpu),
                         format_bytes(r.gpu_checkpointed), format_bytes(r.host),
                         format_bytes(r.nvme) if r.nvme else "-", fits + mark))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        a = self.activations
        lines = [
            f"Memory for {self.model}: {format_count(self.params)} params, {self.precision}, "
            f"{self.optimizer}; {self.nodes} node(s) x {self.gpus_per_node} GPU(s); "
            f"batch {self.batch} x seq {self.seq} per GPU",
            f"activations saved for backward: {format_bytes(a.saved)} without checkpointing, "
            f"{format_bytes(a.saved_checkpointed)} + {format_bytes(a.recompute_peak)} recompute "
            f"peak with the plan's checkpointing ({len(a.per_unit)} units)",
            f"limits: {format_bytes(self.gpu_mem)} per GPU, {format_bytes(self.host_mem)} per host",
        ]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        lines.append(f"recommendation: {self.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _largest_layer_params(model: nn.Module) -> int:
    """DeepSpeed's definition: the most parameters any single module holds itself."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def _default_gpu_mem() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return 80 * GiB


def _default_host_mem() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
    inputs: InputsFn | None = None,
) -> MemoryReport:
    """Per-GPU and per-host memory of every strategy for ``model`` (build it on the meta
    device: nothing is allocated) and the fastest strategy that fits.

    ``gpus`` is GPUs per node; ``batch`` the micro-batch per GPU; ``gpu_mem``/``host_mem``
    in bytes (defaults: the visible GPU, else 80 GiB; this machine's RAM). ``plan`` may be
    a Plan, or a policy/rule to build one (default: the model's marks / HF metadata); its
    checkpoint units are what "with checkpointing" means.
    """
    wrappers = {"DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine"}
    if any(hasattr(p, "device_mesh") for p in model.parameters()) or any(
            k.__name__ in wrappers for k in type(model).__mro__):
        raise MemoryInputError(
            "estimate_memory() takes the bare model (best built on the meta device), not one "
            "already wrapped or sharded by an engine")
    if not isinstance(plan, Plan):
        plan = make_plan(model, plan)
    bpp = BytesPerParam.of(precision, optimizer)  # validates both names
    if gpus < 1 or nodes < 1:
        raise MemoryInputError("--gpus and --nodes must be at least 1")
    gpu_mem = gpu_mem if gpu_mem is not None else _default_gpu_mem()
    host_mem = host_mem if host_mem is not None else _default_host_mem()
    activations = trace_activations(model, plan, batch=batch, seq=seq,
                                    dtype=COMPUTE_DTYPE[precision], inputs=inputs)
    largest_layer = _largest_layer_params(model)
    largest_unit = max([u.params for u in plan.units] + [plan.root.params])
    rows = []
    for strategy in STRATEGIES:
        states = model_states(strategy, bpp, total_params=plan.total_params,
                              largest_layer_params=largest_layer, largest_unit_params=largest_unit,
                              gpus_per_node=gpus, nodes=nodes)
        gpu = states.gpu + activations.saved
        gpu_ckpt = states.gpu + activations.checkpointed_peak
        host_ok = states.host <= host_mem
        rows.append(StrategyRow(
            key=strategy.key, label=strategy.label, states_gpu=states.gpu, host=states.host,
            nvme=states.nvme, gpu=gpu, gpu_checkpointed=gpu_ckpt,
            fits=gpu <= gpu_mem and host_ok, fits_checkpointed=gpu_ckpt <= gpu_mem and host_ok,
        ))
    key, checkpoint, reason = _recommend(rows, plan.total_params, gpu_mem, bool(activations.per_unit))
    return MemoryReport(
        model=type(model).__name__, params=plan.total_params, largest_layer_params=largest_layer,
        largest_unit_params=largest_unit, gpus_per_node=gpus, nodes=nodes, precision=precision,
        optimizer=optimizer, batch=batch, seq=seq, gpu_mem=gpu_mem, host_mem=host_mem,
        activations=activations, rows=tuple(rows), recommendation=key, checkpoint=checkpoint,
        reason=reason,
    )


def _recommend(
    rows: list[StrategyRow], params: int, gpu_mem: int, can_checkpoint: bool
) -> tuple[str | None, bool | None, str]:
    by_key = {r.key: r for r in rows}
    for key, checkpoint in PREFERENCE:
        if checkpoint and not can_checkpoint:
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
            "fsdp2": "parameters must be sharded too (ZeRO-3-like)",
            "zero3": "parameters must be sharded too",
        }.get(key, "it does not fit on the GPUs without moving model states off them")
        return key, checkpoint, (
            f"{row.label} {how}: {format_bytes(need)} of {format_bytes(gpu_mem)} per GPU; {why}"
        )
    return None, None, (
        f"nothing fits {format_bytes(gpu_mem)} per GPU: use more GPUs (--gpus/--nodes), "
        "a smaller --batch or --seq, or more host memory for offload"
    )
