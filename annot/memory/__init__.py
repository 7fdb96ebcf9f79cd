"""Memory estimates: model states per strategy (DeepSpeed's accounting) and activations
traced under FakeTensorMode. `estimate_memory` is the entry point."""

from annot.memory.activations import ActivationEstimate, trace_activations
from annot.memory.report import MemoryReport, StrategyRow, estimate_memory
from annot.memory.states import (
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    BytesPerParam,
    MemoryInputError,
    StateMemory,
    Strategy,
    model_states,
)

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "ActivationEstimate",
    "BytesPerParam",
    "MemoryInputError",
    "MemoryReport",
    "StateMemory",
    "Strategy",
    "StrategyRow",
    "estimate_memory",
    "model_states",
    "trace_activations",
]
