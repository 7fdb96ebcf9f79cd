"""The strategies the planner weighs, each one `annot.auto_wrap` call.

A `Strategy` is an engine name and the options `auto_wrap` passes to it, so whatever the
planner recommends can be built as printed (`Strategy.call`); tests round-trip every one
through the engine's own options check. Precision is chosen separately (``PRECISIONS``)
and maps onto each engine's own way of doing it (`Strategy.precision_options`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from annot.policies.errors import AnnotError

__all__ = ["PRECISIONS", "STRATEGIES", "MemoryInputError", "Strategy", "layout_strategies", "strategy"]

#: ``fp32``; ``amp``: fp32 weights, gradients and optimizer with ``torch.autocast``
#: (bf16) in the training step, how DDP/FSDP users often train; ``bf16-mixed`` /
#: ``fp16-mixed``: 16-bit compute copies of the weights with fp32 master weights
#: (DeepSpeed's ``bf16``/``fp16``, FSDP's ``mixed_precision``; DDP has only autocast, so
#: for DDP this is ``amp``); ``bf16``: everything in bf16, optimizer states too.
PRECISIONS: tuple[str, ...] = ("fp32", "amp", "bf16-mixed", "fp16-mixed", "bf16")


class MemoryInputError(AnnotError, ValueError):
    """An unknown precision, optimizer or strategy, or an impossible hardware setup."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to train: ``auto_wrap(model, engine, **options)``."""

    key: str
    label: str
    engine: str
    options: tuple[tuple[str, Any], ...] = ()
    #: A device mesh for the engine, as (dimension name, size) pairs, outermost first:
    #: ``replicate`` x ``shard`` is HSDP (FSDP2) / ``HYBRID_SHARD`` (FSDP1), ``shard`` x
    #: ``tp`` tensor parallelism under FSDP2. Empty: one dimension over every rank.
    mesh: tuple[tuple[str, int], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    @property
    def stage(self) -> int:
        """ZeRO stage equivalent: 0 replicated (DDP), 1-2 sharded optimizer (and
        gradients), 3 sharded parameters (FSDP with resharding is 3, without it 2)."""
        if self.engine == "ddp":
            return 0
        if self.engine == "deepspeed":
            return int(self.option("stage", 3))
        return 3 if self.option("reshard_after_forward", True) else 2

    @property
    def offload_optimizer(self) -> str | None:
        """Where optimizer states (and fp32 master weights) live: ``None`` on the GPU."""
        if self.engine == "deepspeed":
            return self.option("offload")
        return "cpu" if self.option("offload") else None

    @property
    def offload_params(self) -> bool:
        """Whether sharded parameters live on the host (gathered to the GPU to compute)."""
        if self.engine == "deepspeed":
            return self.stage == 3 and self.option("offload") is not None and self.option(
                "offload_params", True) is not False
        return bool(self.option("offload"))

    def precision_options(self, precision: str) -> dict[str, Any]:
        """The engine options that give ``precision`` (`PRECISIONS`)."""
        if precision not in PRECISIONS:
            raise MemoryInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
        if self.engine == "ddp" or precision in ("fp32", "amp"):
            return {}
        if self.engine == "deepspeed" and precision == "bf16":
            return {"mixed_precision": "bf16"}  # DeepSpeed keeps fp32 master weights anyway
        if precision == "bf16":
            return {}
        return {"mixed_precision": precision.split("-")[0]}

    def engine_options(self, precision: str = "fp32") -> dict[str, Any]:
        """Every keyword ``auto_wrap`` passes to the engine (``nvme_path`` as a placeholder)."""
        options = dict(self.options)
        if options.get("offload") == "nvme":
            options["nvme_path"] = "/local_nvme"
        return {**options, **self.precision_options(precision)}

    def call(self, precision: str = "fp32", checkpoint: bool | None = None) -> str:
        """The ``auto_wrap`` call, as code."""
        args = [f'"{self.engine}"'] + [f"{k}={v!r}" for k, v in self.engine_options(precision).items()]
        if self.mesh:
            names, sizes = zip(*self.mesh, strict=True)
            args.append(f'mesh=init_device_mesh("cuda", {sizes!r}, mesh_dim_names={names!r})')
        if checkpoint is not None:
            args.append(f"checkpoint={checkpoint}")
        if self.engine == "deepspeed" or dict(self.mesh).get("cp", 1) > 1:
            # DeepSpeed builds its optimizer; under cp the Trainable splits the sequences
            args.append("optimizer=make_optimizer")
        text = f"annot.auto_wrap(model, {', '.join(args)})"
        if precision == "bf16":
            text = "model.to(torch.bfloat16); " + text if self.engine != "deepspeed" else text
        if precision == "amp" or (precision.endswith("-mixed") and self.engine == "ddp"):
            dtype = "float16" if precision == "fp16-mixed" else "bfloat16"
            text += f" + torch.autocast(device, torch.{dtype}) around forward"
        return text


def _ds(key: str, label: str, **options: Any) -> Strategy:
    return Strategy(key, label, "deepspeed", tuple(options.items()))


def _torch(key: str, label: str, engine: str, **options: Any) -> Strategy:
    return Strategy(key, label, engine, tuple(options.items()))


STRATEGIES: tuple[Strategy, ...] = (
    _torch("ddp", "DDP", "ddp"),
    _ds("zero1", "ZeRO-1", stage=1),
    _ds("zero2", "ZeRO-2", stage=2),
    _torch("fsdp2-no-reshard", "FSDP2, no reshard", "fsdp2", reshard_after_forward=False),
    _torch("fsdp1-no-reshard", "FSDP1 SHARD_GRAD_OP", "fsdp1", reshard_after_forward=False),
    _torch("fsdp2", "FSDP2", "fsdp2"),
    _torch("fsdp1", "FSDP1", "fsdp1"),
    _ds("zero3", "ZeRO-3", stage=3),
    _ds("zero2-offload", "ZeRO-2 + optimizer on CPU", stage=2, offload="cpu"),
    _ds("zero3-offload-opt", "ZeRO-3 + optimizer on CPU", stage=3, offload="cpu", offload_params=False),
    _torch("fsdp2-offload", "FSDP2 + CPU offload", "fsdp2", offload=True),
    _torch("fsdp1-offload", "FSDP1 + CPU offload", "fsdp1", offload=True),
    _ds("zero3-offload", "ZeRO-3 + params, optimizer on CPU", stage=3, offload="cpu"),
    _ds("zero3-nvme-opt", "ZeRO-3 + optimizer on NVMe", stage=3, offload="nvme", offload_params=False),
    _ds("zero3-nvme", "ZeRO-3 + params, optimizer on NVMe", stage=3, offload="nvme"),
)
_BY_KEY = {s.key: s for s in STRATEGIES}


def strategy(key: str) -> Strategy:
    """The strategy named ``key`` (`MemoryInputError` listing the keys otherwise)."""
    if key not in _BY_KEY:
        raise MemoryInputError(f"unknown strategy {key!r}; choose from {', '.join(_BY_KEY)}")
    return _BY_KEY[key]


def layout_strategies(gpus_per_node: int, nodes: int, *, tp: bool = True) -> tuple[Strategy, ...]:
    """The two-dimensional layouts weighed beside `STRATEGIES` on more than one node,
    each node one group: HSDP on FSDP2 and ``HYBRID_SHARD`` on FSDP1 (replicate over
    nodes x shard inside a node), ZeRO-3 with hpZ (``hpz_partition_size``: the backward
    all-gather inside a node), and with ``tp`` tensor parallelism inside a node under
    FSDP2 sharding across nodes. None on one node."""
    if nodes < 2 or gpus_per_node < 2:
        return ()
    g, m = gpus_per_node, nodes
    hybrid = (("replicate", m), ("shard", g))
    found = [
        Strategy("fsdp2-hsdp", f"FSDP2 HSDP ({m} x {g})", "fsdp2", (), hybrid),
        Strategy("fsdp1-hybrid", f"FSDP1 HYBRID_SHARD ({m} x {g})", "fsdp1", (), hybrid),
        _ds("zero3-hpz", f"ZeRO-3 + hpZ ({g})", stage=3, hpz_partition_size=g),
    ]
    if tp:
        found.append(Strategy("tp-fsdp2", f"TP {g} x FSDP2 {m}", "fsdp2", (), (("shard", m), ("tp", g))))
    return tuple(found)
