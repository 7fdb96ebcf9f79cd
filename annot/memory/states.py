"""DeepSpeed's published model-state estimators, generalised; a reference, not the
planner (the planner models each engine as it runs: `annot.memory.engine_memory`).

The accounting follows DeepSpeed's published estimators
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
in ``deepspeed/runtime/zero``), generalised from their fixed case (16-bit mixed
precision with Adam) to other precisions and optimizers by naming each byte:

==========  ======================================================  mixed+Adam
``param``   parameter in the compute dtype                           2
``grad``    gradient in the compute dtype                            2
``grad32``  gradient in the optimizer's dtype (0 when the same)      4
``master``  fp32 master copy of the parameter (mixed precision)      4
``optim``   optimizer state (Adam: 2 tensors; SGD+momentum: 1)       8
==========  ======================================================  ==========

So DeepSpeed's "18" is ``grad + grad32 + master + optim`` for ZeRO-2 and
``param + grad32 + master + optim`` for ZeRO-3 (where 16-bit gradients are reduced
straight into the fp32 partition), its "16" is ``grad32 + master + optim`` and its
"4 x largest layer" is ``(param + grad) x largest layer``. With mixed precision and Adam
every figure here equals DeepSpeed's (tests/memory/test_states.py checks it).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from annot.memory.strategies import MemoryInputError

__all__ = [
    "BytesPerParam",
    "MemoryInputError",
    "ESTIMATOR_CASES",
    "StateCase",
    "StateMemory",
    "model_states",
]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd-momentum", "sgd")
# DeepSpeed's allowance for fragmentation and temporary buffers on the host.
HOST_BUFFER_FACTOR = 1.5


@dataclasses.dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs, by role (see the module docstring)."""

    param: int
    grad: int
    grad32: int
    master: int
    optim: int

    @classmethod
    def of(cls, precision: str, optimizer: str) -> BytesPerParam:
        if precision not in PRECISIONS:
            raise MemoryInputError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
        if optimizer not in OPTIMIZERS:
            raise MemoryInputError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        states = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
        if precision == "fp32":
            return cls(param=4, grad=4, grad32=0, master=0, optim=4 * states)
        if precision == "bf16":  # pure bf16: no master copy, optimizer states in bf16
            return cls(param=2, grad=2, grad32=0, master=0, optim=2 * states)
        return cls(param=2, grad=2, grad32=4, master=4, optim=4 * states)

    @property
    def grad_partition(self) -> int:
        """Bytes of the gradient the optimizer steps on (fp32 copy if there is one)."""
        return self.grad32 or self.grad

    @property
    def replicated_extra(self) -> int:
        """What DDP keeps per parameter beyond the weight and its gradient."""
        return self.grad32 + self.master + self.optim

    @property
    def optimizer_side(self) -> int:
        """What the optimizer step needs besides the parameter: DeepSpeed's "16"."""
        return self.grad_partition + self.master + self.optim


@dataclasses.dataclass(frozen=True)
class StateCase:
    """One case of DeepSpeed's estimators: ZeRO stage (0 = DDP), what is offloaded where.

    ``gather`` says how the ZeRO-3 gathered working set is sized: ``"module"`` (DeepSpeed
    fetches module by module: the largest module's own parameters) or ``"unit"``
    (FSDP2 gathers a whole shard unit, and prefetches the next one).
    """

    key: str
    label: str
    stage: int
    offload_optimizer: str | None = None
    offload_params: str | None = None
    gather: Literal["module", "unit"] = "module"


ESTIMATOR_CASES: tuple[StateCase, ...] = (
    StateCase("ddp", "DDP", 0),
    StateCase("zero1", "ZeRO-1", 1),
    StateCase("zero2", "ZeRO-2", 2),
    StateCase("zero3", "ZeRO-3", 3),
    StateCase("fsdp2", "FSDP2 full shard", 3, gather="unit"),
    StateCase("zero2-offload-opt-cpu", "ZeRO-2 + optimizer on CPU", 2, offload_optimizer="cpu"),
    StateCase("zero3-offload-opt-cpu", "ZeRO-3 + optimizer on CPU", 3, offload_optimizer="cpu"),
    StateCase("zero3-offload-all-cpu", "ZeRO-3 + params, optimizer on CPU", 3,
             offload_optimizer="cpu", offload_params="cpu"),
    StateCase("fsdp2-offload-cpu", "FSDP2 + CPU offload", 3, offload_optimizer="cpu",
             offload_params="cpu", gather="unit"),
    StateCase("zero3-offload-opt-nvme", "ZeRO-3 + optimizer on NVMe", 3, offload_optimizer="nvme"),
    StateCase("zero3-offload-all-nvme", "ZeRO-3 + params, optimizer on NVMe", 3,
             offload_optimizer="nvme", offload_params="nvme"),
)


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """Bytes of model states: per GPU, per host (node) and on NVMe per node."""

    gpu: int
    host: int
    nvme: int = 0


def model_states(
    strategy: StateCase,
    bpp: BytesPerParam,
    *,
    total_params: int,
    largest_layer_params: int,
    largest_unit_params: int | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
    zero_init: bool = True,
) -> StateMemory:
    """Model-state bytes of ``strategy`` for a model of ``total_params``.

    ``largest_layer_params`` is the largest module's own parameter count (what DeepSpeed
    gathers at a time under ZeRO-3); ``largest_unit_params`` the largest shard unit of the
    Plan (what FSDP2 gathers; it prefetches one more). ``zero_init`` as in DeepSpeed:
    the model is built partitioned, so the host never holds it whole.
    """
    if gpus_per_node < 1 or nodes < 1:
        raise MemoryInputError("--gpus and --nodes must be at least 1")
    P, n, f = total_params, gpus_per_node * nodes, HOST_BUFFER_FACTOR
    per_process_fp32_copy = int(P * 4 * gpus_per_node * f)  # each rank loads the model once
    if strategy.stage in (0, 1, 2) and strategy.offload_params:
        raise MemoryInputError(f"{strategy.label}: parameter offload needs ZeRO-3")
    if strategy.stage == 0:
        return StateMemory(gpu=P * (bpp.param + bpp.grad + bpp.replicated_extra),
                           host=per_process_fp32_copy)
    if strategy.stage == 1:
        return StateMemory(gpu=P * (bpp.param + bpp.grad) + int(bpp.replicated_extra * P / n),
                           host=per_process_fp32_copy)
    if strategy.stage == 2:
        if strategy.offload_optimizer == "cpu":
            host = int(P * max(4 * n, bpp.optimizer_side) * f)
            return StateMemory(gpu=bpp.param * P, host=host)
        if strategy.offload_optimizer:
            raise MemoryInputError("ZeRO-2 offloads the optimizer to CPU only; NVMe needs ZeRO-3")
        return StateMemory(gpu=bpp.param * P + int((bpp.grad + bpp.replicated_extra) * P / n),
                           host=per_process_fp32_copy)
    # ZeRO-3 / FSDP2 full shard.
    if strategy.gather == "unit":
        if largest_unit_params is None:
            raise MemoryInputError(f"{strategy.label} needs the Plan's largest unit")
        gathered = 2 * largest_unit_params * (bpp.param + bpp.grad)  # current + prefetched
    else:
        gathered = largest_layer_params * (bpp.param + bpp.grad)
    init_host = (int(largest_layer_params * 4 * gpus_per_node * f) if zero_init
                 else per_process_fp32_copy)
    sharded_states = (bpp.param + bpp.optimizer_side) * P  # DeepSpeed's "18"
    if not strategy.offload_optimizer:
        return StateMemory(gpu=gathered + int(sharded_states / n), host=init_host)
    offloaded = bpp.optimizer_side * P if not strategy.offload_params else sharded_states
    gpu = gathered if strategy.offload_params else gathered + int(bpp.param * P / n)
    if strategy.offload_optimizer == "nvme":
        # States live on disk; the host keeps swap buffers of about one layer per rank.
        return StateMemory(gpu=gpu, host=init_host, nvme=int(offloaded / nodes))
    factor = 1 / nodes
    if zero_init:
        host = int(offloaded * factor * f)
    else:
        host = int(P * max(4 * gpus_per_node, (offloaded / P) * factor) * f)
    return StateMemory(gpu=gpu, host=host)
