"""Memory planning: per-rank memory of every strategy annot builds (each engine's own
buffers and working sets, read from the config annot writes), traced activations, and
the counter that verifies both (`annot.memory.counting.LiveBytes`). `estimate_memory`
is the entry point; `largest_fit` answers "how large a model, how large a batch"; `fit_budget` chooses the
strategy and each block's activation choice for a memory budget."""

from annot.memory.activations import ActivationEstimate, StepTrace, trace_activations, trace_step
from annot.memory.budget import BudgetAnswer, BudgetError, budget_solver, fit_budget
from annot.memory.counting import LiveBytes
from annot.memory.engine_memory import OPTIMIZERS, ModelFacts, RankMemory, model_facts, rank_memory
from annot.memory.report import MARGIN, RESERVE, MemoryReport, StrategyRow, estimate_memory
from annot.memory.states import BytesPerParam, StateMemory, model_states
from annot.memory.strategies import PRECISIONS, STRATEGIES, MemoryInputError, Strategy, strategy

__all__ = [
    "MARGIN",
    "OPTIMIZERS",
    "PRECISIONS",
    "RESERVE",
    "STRATEGIES",
    "ActivationEstimate",
    "BudgetAnswer",
    "BudgetError",
    "BytesPerParam",
    "LiveBytes",
    "MemoryInputError",
    "MemoryReport",
    "ModelFacts",
    "RankMemory",
    "StateMemory",
    "StepTrace",
    "Strategy",
    "StrategyRow",
    "budget_solver",
    "estimate_memory",
    "fit_budget",
    "model_facts",
    "model_states",
    "rank_memory",
    "strategy",
    "trace_activations",
    "trace_step",
]
