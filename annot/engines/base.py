"""The engine contract: what each engine module gives `annot.auto_wrap`.

An engine is an `Engine` subclass with a frozen ``Options`` dataclass. `auto_wrap` owns
the order of the steps and calls them in it (docs/design.md, "Engine contract"):

1. ``Options(**user_options)``: the engine's own options; anything it cannot honour is
   refused there (an unknown name is a `TypeError` listing what it takes);
2. `Engine.checkpoint_paths`: which modules to checkpoint (the Plan's, all, none; an
   engine may drop what it cannot checkpoint, saying so);
3. `Engine.prepare`: run-time tools inside the units (checkpointing, activation
   offload), which must be in place before the engine hooks or wraps the modules;
4. `Engine.wrap`: shard, replicate or partition; a `meta_init` model gets storage here
   (FSDP2: its shards; FSDP1, ZeRO-3: unit by unit) or in `fill` before it;
5. `Engine.fill`: values for a `meta_init` model, from its record or a checkpoint, into
   the storage this rank keeps (`Engine.layout` says where that is);
6. `Engine.trainable`: with an optimizer factory, the uniform training surface
   `Trainable` (``backward``, ``step``, ``zero_grad``), so a training loop never
   branches on the engine.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from annot.checkpoint_io.loading import load_logged
from annot.devices import move_to_device
from annot.errors import EngineNotAvailableError
from annot.meta.layout import WHOLE, ShardLayout
from annot.meta.materialization import materialize
from annot.policies import Action, Plan
from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.runtime.activation_offload import apply_activation_offload, offloaded_activation_paths
from annot.runtime.units import unit_paths

__all__ = [
    "Engine",
    "OptimizerFactory",
    "Trainable",
    "WrapRequest",
    "checkpoint_and_offload_activations",
    "fill_values",
    "refuse_nvme_marks",
    "resolve_dtype",
    "resolve_torch_offload",
    "trained_parameters",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None, "no": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def resolve_dtype(mixed_precision: Any) -> Any:
    """``None`` for full precision, a torch dtype for a name (``"bf16"``, ``"fp16"``,
    ``"fp32"``), anything else as given (a dtype, or an engine's own policy object)."""
    if not isinstance(mixed_precision, str):
        return mixed_precision
    if mixed_precision.lower() not in _DTYPES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r}: use 'bf16', 'fp16', 'fp32', a torch dtype "
            "or the engine's own policy object")
    return _DTYPES[mixed_precision.lower()]


@dataclasses.dataclass(frozen=True)
class WrapRequest:
    """What `auto_wrap` resolved before the engine's steps, the same for every engine."""

    plan: Plan
    device: torch.device
    #: Built under `annot.meta_init` and not given values yet.
    deferred: bool
    #: A checkpoint to fill a deferred model from (else its record is replayed).
    load_from: Path | None = None
    #: Map ``load_from``'s tensors instead of reading them (`annot.load`'s ``mmap``).
    mmap: bool = False


@dataclasses.dataclass
class Trainable:
    """A wrapped model with its optimizer: the training surface every engine shares.

    Call it like the model; ``backward(loss)``, ``step()``, ``zero_grad()`` are the
    engine's (DeepSpeed's own for DeepSpeed, which scales losses and accumulates
    gradients itself; plain ``loss.backward()`` and the optimizer's for the torch
    engines). ``module`` is what runs forward (the engine's wrapper; FSDP2's is the model
    itself), ``model`` the bare model with its original parameter names. ``device`` is
    where the engine computes: a call moves the tensors it is given there first (DDP and
    FSDP do so on a GPU themselves, DeepSpeed does not), so one loop feeding CPU batches
    runs on every engine; ``None`` leaves them where they are.
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    engine: str
    device: torch.device | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.device is not None:
            args, kwargs = move_to_device(args, kwargs, self.device)
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def train(self, mode: bool = True) -> Trainable:
        self.module.train(mode)
        return self

    def eval(self) -> Trainable:
        return self.train(False)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()


OptionsT = TypeVar("OptionsT")


class Engine(Generic[OptionsT]):
    """One engine's steps. Subclasses set ``name`` and ``Options`` and override the steps
    whose default does not fit; the defaults are what the torch engines share."""

    name: ClassVar[str]
    Options: ClassVar[type[Any]]
    #: Whether `fill` runs before `wrap` (engines that broadcast or replicate real values
    #: at wrap time, DDP) instead of after it.
    fills_before_wrap: ClassVar[bool] = False
    #: Whether its parameters can be tensors mapped from a checkpoint (``mmap=True``):
    #: not for engines that keep flattened parameters of their own.
    maps_checkpoint: ClassVar[bool] = True
    #: Whether `auto_wrap` needs ``optimizer=`` (an engine that builds it itself).
    requires_optimizer: ClassVar[bool] = False
    #: Option names other engines take -> what to use with this one instead.
    hints: ClassVar[dict[str, str]] = {}

    def options(self, given: OptionsT | None, **kwargs: Any) -> OptionsT:
        """The engine's options from an ``Options`` instance or keyword arguments."""
        if given is not None:
            if kwargs:
                raise TypeError(
                    f"pass engine options either as options= or as keywords, not both "
                    f"({', '.join(kwargs)})")
            if not isinstance(given, self.Options):
                raise TypeError(f"engine {self.name!r} takes {self.Options.__name__}, "
                                f"not {type(given).__name__}")
            return given
        fields = {f.name for f in dataclasses.fields(self.Options)}
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            hints = [self.hint(k) for k in unknown]
            raise TypeError(
                f"engine {self.name!r} has no option {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(sorted(fields))}"
                + "".join(f". {h}" for h in hints if h))
        options: OptionsT = self.Options(**kwargs)
        return options

    def hint(self, option: str) -> str:
        """Why ``option`` is not this engine's, and what to use instead ("" if no hint)."""
        return self.hints.get(option, "")

    def check(self, model: nn.Module, request: WrapRequest, options: OptionsT) -> None:
        """Refuse, before anything changes, what this engine cannot do with the request's
        Plan on its device."""

    def checkpoint_paths(self, model: nn.Module, plan: Plan, choice: bool | None) -> list[str]:
        """Modules to checkpoint: the Plan's (``None``), every unit (``True``), none."""
        return unit_paths(plan, Action.CHECKPOINT, choice)

    def prepare(self, model: nn.Module, request: WrapRequest, options: OptionsT,
                checkpoint_paths: Sequence[str]) -> None:
        """Install run-time tools inside the units: torch's non-reentrant checkpointing."""
        apply_checkpointing(model, checkpoint_paths)

    def wrap(self, model: nn.Module, request: WrapRequest, options: OptionsT) -> nn.Module:
        raise NotImplementedError

    def layout(self, wrapped: nn.Module) -> ShardLayout:
        """Where this rank keeps ``wrapped``'s parameters (DTensors describe themselves)."""
        return WHOLE

    def fill(self, wrapped: nn.Module, request: WrapRequest) -> None:
        """Values for a deferred model, into the storage this rank keeps."""
        fill_values(wrapped, request.load_from, request.device, self.layout(wrapped), request.mmap)

    def trainable(self, wrapped: nn.Module, model: nn.Module, optimizer: OptimizerFactory,
                  options: OptionsT, *, device: torch.device) -> Trainable:
        """``wrapped`` with an optimizer over the parameters it trains (those that
        require grad: frozen ones get no optimizer state), moving its inputs to
        ``device`` (the request's: where the engine computes)."""
        return Trainable(wrapped, model, optimizer(trained_parameters(wrapped)), self.name,
                         device)


def trained_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that require grad, each once."""
    return [p for p in module.parameters() if p.requires_grad]


def fill_values(model: nn.Module, load_from: str | os.PathLike[str] | None,
                device: torch.device | None, layout: ShardLayout = WHOLE, mmap: bool = False) -> None:
    """Values for a `meta_init` model that has storage (or not yet): loaded from
    ``load_from`` (what it lacks keeps its initialization, logged), else replayed from
    its construction record."""
    if load_from is not None:
        load_logged(model, load_from, device, layout, mmap)
    else:
        materialize(model, device=device, layout=layout)


def refuse_nvme_marks(plan: Plan, engine: str) -> None:
    """A torch engine cannot honour a Plan that offloads units to NVMe."""
    wanted = [u.path for u in plan.units if u.offload_to == "nvme"]
    if wanted:
        raise EngineNotAvailableError(
            f"the Plan offloads {', '.join(wanted)} to NVMe, but {engine} offloads to CPU at "
            "most (NVMe offload is engine='deepspeed'): pass offload=False to train without "
            "it, or mark those modules offload='cpu'")


def resolve_torch_offload(offload: bool | str | None, engine: str) -> bool | None:
    """A torch engine's parameter offload: ``None`` (the Plan's marks), ``True`` (``"cpu"``)
    or ``False``; NVMe is DeepSpeed's."""
    if offload == "nvme":
        raise EngineNotAvailableError(
            f"offload='nvme' with engine {engine!r}: NVMe offload is DeepSpeed's "
            "(engine='deepspeed'); torch engines offload to CPU")
    if offload not in (None, True, False, "cpu"):
        raise ValueError(f"offload must be None, True, False or 'cpu', got {offload!r}")
    return True if offload == "cpu" else offload  # type: ignore[return-value]


def checkpoint_and_offload_activations(model: nn.Module, plan: Plan,
                                       checkpoint_paths: Sequence[str],
                                       offload_activations: bool | None) -> None:
    """The torch engines' run-time tools inside the units: non-reentrant checkpointing,
    then activation offload (``None``: the units the Plan marks offload)."""
    apply_checkpointing(model, checkpoint_paths)
    apply_activation_offload(model, offloaded_activation_paths(plan, offload_activations))
