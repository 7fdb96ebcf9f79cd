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
   branches on the engine; with fp16 compute it scales the loss (`Engine.loss_scaler`).

After wrapping, the generic modules ask the engine, never import it
(docs/design.md, "Engine contract"):

- `Engine.layout`: where this rank keeps a model's parameters (`annot.materialize`,
  `annot.load`, `annot.save`; asked of every engine through `annot.engines.layout`);
- `Engine.after_write`: annot wrote values into those parameters; refresh any copy the
  engine keeps of them (ZeRO++ hpZ);
- `Engine.state`: the `EngineState` that saves and loads a `Trainable`'s model and
  optimizer state (`annot.save_state` / `annot.load_state`);
- `Engine.checkpoint_function`: the run-time activation checkpoint to call inside a
  unit (`Engine.prepare`, `annot.apply_checkpointing`).

The engines themselves are found by name in `annot.engines.registry`, the one generic
module that imports an engine's module.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import nn

from annot._deprecation import warn_deprecated
from annot.checkpoint_io.formats import CheckpointSource
from annot.checkpoint_io.loading import load_source
from annot.devices import move_to_device
from annot.errors import EngineNotAvailableError
from annot.meta.layout import WHOLE, ShardLayout
from annot.meta.materialization import materialize
from annot.policies import Action, Plan
from annot.policies.planner import cache_writers
from annot.process_group import rank_and_world
from annot.runtime.activation_checkpoint import CheckpointFn, torch_checkpoint
from annot.runtime.activation_offload import apply_activation_offload, offloaded_activation_paths
from annot.runtime.context_parallel import ContextParallel
from annot.runtime.selective_checkpoint import apply_plan_checkpointing
from annot.runtime.units import unit_paths

if TYPE_CHECKING:
    from torch.amp import GradScaler

    # What the torch engines return, named here so that generic modules (auto_wrap's
    # overloads) can type it without importing an engine's module.
    from torch.distributed.fsdp import FullyShardedDataParallel as FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel as DistributedDataParallel

__all__ = [
    "INIT_SCALE",
    "CheckpointFunction",
    "Engine",
    "EngineState",
    "OptimizerFactory",
    "Reader",
    "RenamedOption",
    "Trainable",
    "WrapRequest",
    "checkpoint_and_offload_activations",
    "fill_values",
    "is_fp16",
    "refuse_nvme_marks",
    "refuse_plan_activation_choices",
    "resolve_dtype",
    "resolve_torch_offload",
    "trained_parameters",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: A run-time activation checkpoint: ``(function, *args, **kwargs)`` -> the function's output.
CheckpointFunction = CheckpointFn
#: Reads the saved checkpoint into a state dict, in place (``dcp.load``).
Reader = Callable[[dict[str, Any]], None]

_log = logging.getLogger("annot")

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
    #: A checkpoint to fill a deferred model from, with its format (else its record is
    #: replayed).
    load_from: CheckpointSource | None = None
    #: Map ``load_from``'s tensors instead of reading them (`annot.load`'s ``mmap``).
    mmap: bool = False


@dataclasses.dataclass
class Trainable:
    """A wrapped model with its optimizer: the training surface every engine shares.

    Call it like the model; ``backward(loss)``, ``step()``, ``zero_grad()`` are the
    engine's (DeepSpeed's own for DeepSpeed, which scales losses and accumulates
    gradients itself; the optimizer's for the torch engines). ``module`` is what runs
    forward (the engine's wrapper; FSDP2's is the model itself), ``model`` the bare model
    with its original parameter names.

    fp16 compute (``mixed_precision="fp16"`` on FSDP2, FSDP1, DDP) gives the torch
    engines a ``scaler`` (torch's ``ShardedGradScaler`` for the FSDPs, ``GradScaler`` for
    DDP): ``backward`` multiplies the loss by the scale so small gradients do not
    underflow to zero in fp16 (docs/design.md, pitfall 34), ``step`` unscales the
    gradients, skips the optimizer step if any of them is inf or NaN on any rank,
    and adapts the scale. A skipped step leaves the parameters and the optimizer state
    as they were; it is counted in ``skipped_steps`` and logged on rank 0. The training
    loop stays ``backward(loss); step(); zero_grad()``. Gradients between ``backward``
    and ``step`` are scaled: clip them with `clip_grad_norm_`, which unscales first.
    ``save_state``/``load_state`` keep the scaler's state and the count.
    ``device`` is where the engine computes: a call moves the tensors it is given there
    first (DDP and FSDP do so on a GPU themselves, DeepSpeed does not), so one loop feeding
    CPU batches runs on every engine; ``None`` leaves them where they are.
    ``context_parallel`` (FSDP2 with a ``"cp"`` mesh dimension): a call gets the whole
    sequences, runs on this rank's part of them and returns the whole sequence's loss
    (`annot.runtime.context_parallel`; other outputs, the logits, stay this rank's part);
    ``backward`` recomputes checkpointed attention over the whole sequence again.
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    engine: str
    #: Where the engine computes; a call moves its tensors there (``None``: left as given).
    device: torch.device | None = None
    #: The loss scaler of fp16 compute (``None``: no scaling, fp32 or bf16).
    scaler: GradScaler | None = None
    #: Optimizer steps the scaler skipped because a gradient was inf or NaN.
    skipped_steps: int = 0
    #: The sequence split of context parallelism (``None``: each rank has whole sequences).
    context_parallel: ContextParallel | None = None
    #: Run after each optimizer step, in order (float8 all-gather's scale refresh:
    #: `annot.float8.refresh_float8_scales`).
    after_step: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    #: Whether the gradients of this step are unscaled already (`clip_grad_norm_`).
    _unscaled: bool = dataclasses.field(default=False, init=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.device is not None:
            args, kwargs = move_to_device(args, kwargs, self.device)
        if self.context_parallel is not None:
            return self.context_parallel.call(self.module, args, kwargs)
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self.context_parallel is not None:
            # A checkpointed block recomputes its attention in backward: split again.
            with self.context_parallel.attention():
                self._backward(loss)
        else:
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def step(self) -> None:
        self._step()
        for after in self.after_step:
            after()

    def _step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        before = self.scaler.get_scale()
        # Unscales (unless clip_grad_norm_ did), checks every rank's gradients for
        # inf/NaN (ShardedGradScaler all-reduces the finding), steps only if none.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._unscaled = False
        after = self.scaler.get_scale()
        # update() lowers the scale exactly when this step found inf/NaN and was skipped
        # (it raises it, or keeps it, otherwise). Reading the scale waits for the device,
        # as scaler.step already did to decide whether to step.
        if after < before:
            self.skipped_steps += 1
            if rank_and_world()[0] == 0:
                _log.warning(
                    "fp16 loss scaling: inf/NaN gradients, optimizer step skipped (parameters "
                    "unchanged; %d skipped so far); loss scale %g -> %g", self.skipped_steps,
                    before, after)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the trained parameters to total norm ``max_norm`` (over
        every rank's shards) and return the norm before clipping. Call it between
        ``backward`` and ``step``. With a loss scaler the gradients are unscaled first,
        so ``max_norm`` is in the loss's units; a norm that is inf or NaN leaves the
        gradients so, and ``step`` then skips the step."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True
        return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The engine's clipping of unscaled gradients: torch's ``clip_grad_norm_`` takes
        whole tensors (DDP) and DTensors (FSDP2, whose norms it reduces over the mesh);
        DTensors on several meshes (expert parallelism) go through `clip_across_meshes`."""
        params = trained_parameters(self.module)
        if len(_by_mesh(params)) > 1:
            return clip_across_meshes(params, max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def loss_scaler_state(self) -> dict[str, Any] | None:
        """The scaler's state and the skipped-step count as JSON data (``None`` without a
        scaler), for `annot.save_state`."""
        if self.scaler is None:
            return None
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_loss_scaler_state(self, state: dict[str, Any] | None, where: str = "the checkpoint") -> None:
        """Restore what `loss_scaler_state` gave. A state without a scaler's part into
        an fp16 run starts from the initial scale, and a scaler's state into a run that
        does not scale is dropped; both are logged."""
        if self.scaler is None:
            if state is not None:
                _log.warning("%s holds an fp16 loss scaler's state, but this run does not scale "
                             "its loss (no fp16 compute): the state is not used", where)
            return
        if state is None:
            _log.warning("%s holds no loss scaler state (saved without fp16 compute): the loss "
                         "scale starts at %g", where, self.scaler.get_scale())
            return
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def train(self, mode: bool = True) -> Trainable:
        self.module.train(mode)
        return self

    def eval(self) -> Trainable:
        return self.train(False)

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.module.parameters()


#: The loss scalers' first scale: torch's default, 2^16, is one more than fp16 holds
#: (65504). Where the loss itself is fp16 (FSDP's fp16 compute returns it so), the
#: gradient reaching it is the scale, inf at 2^16: the first step was always skipped
#: (measured on FSDP2 and FSDP1, 2 CPU ranks: every gradient NaN).
INIT_SCALE = 2.0 ** 15


def is_fp16(dtype: Any) -> bool:
    """Whether a resolved ``mixed_precision`` (a dtype, or an engine's policy object with
    a ``param_dtype``) computes in fp16, which needs loss scaling."""
    return getattr(dtype, "param_dtype", dtype) == torch.float16


class EngineState(Protocol):
    """What `annot.save_state` / `annot.load_state` ask of an engine (`Engine.state`).
    The layout is torch's for distributed checkpoints (`annot.engines.training_state`)."""

    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        """``(state, param_groups, engine_extras)``: the tensors to hand to ``dcp.save``
        (this rank's pieces), the optimizer's param groups as JSON-able data (``params``:
        the bare names), and small engine counters (JSON-able)."""
        ...

    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        """Read model and optimizer state with ``read``; ``keys`` is the checkpoint's
        tensor metadata by key (shapes and dtypes, nothing read yet)."""
        ...


OptionsT = TypeVar("OptionsT")


@dataclasses.dataclass(frozen=True)
class RenamedOption:
    """An engine option of the previous release, now spelled ``option``: ``convert``
    maps the old value to the new option's value (and raises for a value that has none)."""

    option: str
    convert: Callable[[Any], Any]


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
    #: Option names of the previous release this engine still takes, with a
    #: `DeprecationWarning`, until the release `annot._deprecation.REMOVED_IN`.
    deprecated_options: ClassVar[dict[str, RenamedOption]] = {}

    def optimizer_needed(self) -> str | None:
        """Why `auto_wrap` needs ``optimizer=`` for what `check` saw (``None``: it does
        not). Asked after `check`; `requires_optimizer` engines always need one."""
        return None

    def gathers_in_module_order(self) -> bool:
        """Whether, for what `check` saw, the engine gathers parameters module by module
        in the order the modules run (DeepSpeed ZeRO-3), rather than per unit at the
        unit's forward: then every rank must run a tower at the same point of the forward
        (`annot.huggingface.modality_standin`). Asked after `check`."""
        return False

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
        kwargs = self._renamed(kwargs)
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

    def _renamed(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with each deprecated option replaced by the option and value that
        mean the same now; an explicit new option that says otherwise is a `ValueError`."""
        out = dict(kwargs)
        for old, renamed in self.deprecated_options.items():
            if old not in out:
                continue
            value = out.pop(old)
            new_value = renamed.convert(value)
            spelled = f"{renamed.option}={new_value!r}"
            if renamed.option in out and out[renamed.option] != new_value:
                raise ValueError(
                    f"engine {self.name!r}: {old}={value!r} (deprecated) means {spelled}, "
                    f"but {renamed.option}={out[renamed.option]!r} was passed too: pass "
                    f"{renamed.option}= alone")
            warn_deprecated(f"engine {self.name!r} option {old}={value!r}", spelled)
            out[renamed.option] = new_value
        return out

    def hint(self, option: str) -> str:
        """Why ``option`` is not this engine's, and what to use instead ("" if no hint)."""
        return self.hints.get(option, "")

    def check(self, model: nn.Module, request: WrapRequest, options: OptionsT) -> None:
        """Refuse, before anything changes, what this engine cannot do with the request's
        Plan on its device."""

    def checkpoint_paths(self, model: nn.Module, plan: Plan, choice: bool | None) -> list[str]:
        """Modules to checkpoint: the Plan's (``None``), every unit (``True``) but those
        writing a key/value cache the model cannot turn off (XLM: recomputing them writes
        it twice, pitfall 14; logged), none (``False``)."""
        paths = unit_paths(plan, Action.CHECKPOINT, choice)
        if choice is True:
            writers = set(cache_writers(model, paths))
            if writers:
                _log.warning("checkpoint=True: not checkpointing %s: they take a key/value cache "
                               "that %s cannot turn off; recomputing them would write it twice",
                               ", ".join(sorted(writers)), type(model).__name__)
                paths = [p for p in paths if p not in writers]
        return paths

    def prepare(self, model: nn.Module, request: WrapRequest, options: OptionsT,
                checkpoint_paths: Sequence[str]) -> None:
        """Install run-time tools inside the units: `checkpoint_function` around each (a
        unit naming a selective policy gets that policy's checkpoint)."""
        apply_plan_checkpointing(model, request.plan, checkpoint_paths, self.checkpoint_function())

    def wrap(self, model: nn.Module, request: WrapRequest, options: OptionsT) -> nn.Module:
        raise NotImplementedError

    def layout(self, wrapped: nn.Module) -> ShardLayout:
        """Where this rank keeps ``wrapped``'s parameters (DTensors describe themselves).
        Asked of every engine about any model (`annot.engines.layout`): a model this
        engine did not shard gives an empty layout."""
        return WHOLE

    def after_write(self, model: nn.Module) -> None:
        """annot just wrote values into the parameters this rank keeps (`annot.materialize`,
        `annot.load`): bring any copy this engine keeps of them up to date. Asked of every
        engine about any model; the default keeps no copy."""

    def checkpoint_function(self) -> CheckpointFunction:
        """The run-time activation checkpoint inside this engine's units: torch's
        non-reentrant one."""
        return torch_checkpoint

    def state(self, trainable: Trainable) -> EngineState:
        """How ``trainable``'s model and optimizer state is saved and loaded
        (`annot.save_state`); an engine without one cannot save training state."""
        raise EngineNotAvailableError(
            f"engine {self.name!r} cannot save or load a training state (annot.save_state)")

    def fill(self, wrapped: nn.Module, request: WrapRequest) -> None:
        """Values for a deferred model, into the storage this rank keeps."""
        fill_values(wrapped, request.load_from, request.device, self.layout(wrapped), request.mmap)

    def trainable(self, wrapped: nn.Module, model: nn.Module, optimizer: OptimizerFactory,
                  options: OptionsT, *, device: torch.device | None = None) -> Trainable:
        """``wrapped`` with an optimizer over the parameters it trains (those that
        require grad: frozen ones get no optimizer state), moving its inputs to
        ``device`` (the request's: where the engine computes), with the loss scaler
        `loss_scaler` gives for ``device`` (``None``: the CPU)."""
        return Trainable(wrapped, model, optimizer(trained_parameters(wrapped)), self.name,
                         device=device,
                         scaler=self.loss_scaler(options, device or torch.device("cpu")))

    def loss_scaler(self, options: OptionsT, device: torch.device) -> GradScaler | None:
        """The loss scaler these options need on ``device``: ``None`` unless the engine
        computes in fp16 (bf16 has fp32's exponent range and needs none)."""
        return None


def _by_mesh(params: list[nn.Parameter]) -> dict[object, list[nn.Parameter]]:
    """Those of ``params`` that have a gradient, grouped by the mesh of their DTensor
    (``None``: plain tensors). torch's norm and clip refuse to mix meshes in one operation."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def clip_across_meshes(params: list[nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip ``params``' gradients to total norm ``max_norm`` where they are DTensors on
    different meshes (expert stacks on the expert mesh, the rest on the dense one):
    each mesh's total norm is reduced over its own mesh (`full_tensor`), the norms are
    combined as one norm of every element (the ``norm_type`` norm of the per-mesh norms),
    and each group is scaled by the same coefficient. Returns the total norm
    as a plain tensor (the same value on every rank)."""
    groups = _by_mesh(params)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    # The p-norm of the per-mesh p-norms is the p-norm of every element (inf, -inf, 0 too).
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device, torch.float32) for n in norms]),
                                     norm_type)
    for group in groups.values():  # takes the parameters, and scales their .grad
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def trained_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that require grad, each once."""
    return [p for p in module.parameters() if p.requires_grad]


def fill_values(model: nn.Module, load_from: CheckpointSource | None,
                device: torch.device | None, layout: ShardLayout = WHOLE, mmap: bool = False) -> None:
    """Values for a `meta_init` model that has storage (or not yet): loaded from
    ``load_from`` (what it lacks keeps its initialization, logged), else replayed from
    its construction record."""
    if load_from is not None:
        load_source(model, load_from, device, layout, mmap)
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
    """The torch engines' run-time tools inside the units: non-reentrant checkpointing
    (selective where the unit names a policy), then activation offload (``None``: the
    units the Plan marks offload; a unit whose ``offload_activations`` is set is
    offloaded whatever the option says: the Plan asked for that unit)."""
    apply_plan_checkpointing(model, plan, checkpoint_paths, torch_checkpoint)
    paths = offloaded_activation_paths(plan, offload_activations)
    asked = [p for u in plan.units if u.offload_activations for p in u.modules if p not in paths]
    apply_activation_offload(model, [*paths, *asked])


def refuse_plan_activation_choices(plan: Plan, engine: str, *, selective: bool,
                                   offload: bool) -> None:
    """An engine that cannot run a unit's selective checkpoint (``selective`` False) or
    activation offload (``offload`` False) refuses a Plan asking for one, naming the units."""
    for can, what, units, fix in (
            (selective, "a selective checkpoint", [u.path for u in plan.units if u.checkpoint_policy],
             "full checkpointing (checkpoint_policy=None) or engine='fsdp2'/'fsdp1'/'ddp'"),
            (offload, "activation offload", [u.path for u in plan.units if u.offload_activations],
             "engine='fsdp2' or 'ddp'")):
        if units and not can:
            raise EngineNotAvailableError(
                f"the Plan asks {what} for {', '.join(units[:3])}{' ...' if len(units) > 3 else ''}, "
                f"which engine {engine!r} cannot run: use {fix}")
