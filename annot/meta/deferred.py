"""Deferred construction: build a model with no memory, keeping how to initialize it.

``with annot.meta_init(): model = GPT(config)`` runs the constructor under
``FakeTensorMode`` (shapes only, no data) while a dispatch mode records every tensor
operation on a tape: creations, init functions (``reset_parameters``, HuggingFace
``_init_weights``, anything custom in ``__init__``), how non-persistent buffers are
computed. Fake tensors report the CPU device, so libraries that skip initialization on
the meta device (transformers does) still run it, and it lands on the tape. On exit the
model's tensors become ordinary meta tensors (ties kept: one object under every name)
and the tape is attached to the model. `annot.materialize` replays it.

Replaying the tape from the random-number state at entry repeats the constructor's
exact sequence of operations, so the values are bitwise those of plain eager
construction with the same seed, whatever the number of ranks.

`meta_device_init` records the same way on real meta tensors: faster (no fake-tensor
dispatch), for a model a checkpoint will fill, since initialization that libraries skip
on the meta device is missing from its tape (docs/design.md, pitfall 29).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from annot.meta.tape import (
    Op,
    Ref,
    TensorLayout,
    draws_random_numbers,
    leaves,
    map_leaves,
    writes_of,
)
from annot.meta.tensor_attributes import map_tensor_attributes
from annot.meta.value_reads import VALUE_READ_LIMIT, value_of
from annot.module_state import module_state, peek_state
from annot.policies.errors import AnnotError

__all__ = [
    "UNINITIALIZED",
    "DeferredInit",
    "DeferredInitError",
    "Ref",
    "TensorLayout",
    "build",
    "deferred_init_of",
    "leaves",
    "map_leaves",
    "meta_device_init",
    "meta_init",
    "register_init",
]

M = TypeVar("M", bound=nn.Module)
# Creations whose contents are undefined: a tensor made only by these was never initialized.
UNINITIALIZED = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


class DeferredInitError(AnnotError, RuntimeError):
    """Construction could not be recorded, or the record cannot initialize the model."""


@dataclasses.dataclass
class DeferredInit:
    """What `materialize` needs: the tape, the random state at the start, constants (real
    tensors the constructor passed in), each tensor's storage group, and which tape tensor
    every parameter and buffer name ends as."""

    ops: list[Op]
    rng_state: torch.Tensor
    constants: dict[int, torch.Tensor]
    group_of: dict[int, int]  # ref index -> storage group (aliases share one)
    written: set[int]  # storage groups some operation gave contents to
    tensors: dict[str, int]  # parameter/buffer name -> ref index (tied names share one)
    module_of: dict[str, str]  # parameter/buffer name -> owning module path
    layout: dict[int, TensorLayout]  # ref index -> shape, stride, dtype, whole-storage flag
    # Set when an engine gave the model storage unit by unit (FSDP1, ZeRO-3) and its
    # values are not filled yet; `materialize` (or `annot.load`) clears it.
    pending: bool = False
    # Recorded on the meta device (`meta_device_init`): library init skipped there is
    # missing from the tape.
    on_meta_device: bool = False
    # Plain tensor attributes the constructor computed (`annot.meta.tensor_attributes`:
    # name -> ref index): left on the meta device, filled whole by `materialize`.
    attributes: dict[str, int] = dataclasses.field(default_factory=dict)

    def uninitialized(self) -> list[str]:
        """Names of parameters/buffers nothing ever wrote."""
        return [n for n, r in self.tensors.items() if self.group_of[r] not in self.written]


class _Recorder(TorchDispatchMode):
    """Records every aten op under it; runs it on (fake) tensors as usual, on one device.

    Every device other than the CPU an operation names (``nn.Linear(..., device="cuda")``,
    a factory inside ``with torch.device("cuda")``, ``.to("cuda")``) becomes the build
    device (fake CPU tensors, or the meta device) before the operation runs, and the tape
    keeps the CPU:
    the replay then draws every random number from the one CPU generator, in eager
    order, so the values are bitwise an eager CPU build's with the same seed whatever
    device a constructor named (a CUDA tensor would draw from the CUDA generator instead:
    other values, and other values on each rank; docs/design.md, pitfall 33). The device
    named is kept on the operation (`Op.named_device`)."""

    def __init__(self, on_meta_device: bool = False) -> None:
        super().__init__()
        # Built on the meta device, factories were told ``device="meta"``: the replay
        # builds on the CPU, so the record says "cpu" (fake tensors say it already).
        self.on_meta_device = on_meta_device
        self.build_device = torch.device("meta") if on_meta_device else _CPU
        self.ops: list[Op] = []
        self.index: dict[int, int] = {}  # id(tensor) -> ref index
        self.refs: list[Ref] = []  # by index: one object each, made once
        self.func: Any = None  # the operation being recorded (named in a refusal)
        self.alive: list[torch.Tensor] = []  # keeps ids and storages unique while recording
        self.constants: dict[int, torch.Tensor] = {}
        self.group_of: dict[int, int] = {}
        self.storage_group: dict[int, int] = {}
        self.written: set[int] = set()
        self.layout: dict[int, TensorLayout] = {}
        self.views: dict[tuple[Any, ...], int] = {}  # (storage, offset, shape, stride, dtype) -> ref
        self.made: set[int] = set()  # refs some operation returned, or constants
        # Operations on fake tensors draw nothing from the CPU generator, so its state
        # changes inside the block only when the user's code sets it (a seed between two
        # layers): each such change is recorded with the next operation that draws random
        # numbers, for the replay. Only those read the state; checking it at every
        # operation (a copy of the generator's state and a compare each) took 0.01-0.03 s
        # of the 0.07-0.10 s a 1.1B Llama's meta-device build took here (best of 20).
        self.rng_state = torch.get_rng_state()

    def ref(self, t: torch.Tensor) -> Ref:
        i = self.index.get(id(t))
        if i is not None:
            return self.refs[i]
        key = StorageWeakRef(t.untyped_storage()).cdata
        if self.on_meta_device:
            # On the meta device ``nn.Parameter(t)`` is a new tensor object over ``t``'s
            # storage made without a dispatched operation (fake tensors dispatch a
            # ``detach``): the same view of the same storage is the same recorded tensor.
            view = (key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            i = self.views.get(view)
            if i is not None:
                self.index[id(t)] = i
                self.alive.append(t)
                return self.refs[i]
        i = len(self.refs)
        self.refs.append(Ref(i))
        self.index[id(t)] = i
        self.alive.append(t)
        if self.on_meta_device:
            self.views[view] = i
        self.group_of[i] = self.storage_group.setdefault(key, len(self.storage_group))
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and t.numel() * t.element_size() == t.untyped_storage().nbytes())
        self.layout[i] = TensorLayout(tuple(t.shape), tuple(t.stride()), t.dtype, whole)
        # A real tensor from outside, or a fake one standing for a literal
        # (`torch.tensor(5.0)` under FakeTensorMode keeps its value in `.constant`
        # and reaches the tape only through `lift_fresh`): a constant.
        # A meta tensor holds no value: only ever a tensor the recording made.
        value = (getattr(t, "constant", None) if isinstance(t, FakeTensor)
                 else None if t.is_meta else t)
        if value is not None:
            with _disable_current_modes():  # a real copy, not a fake one; on the CPU,
                # where the replay runs (a constant the caller made on a GPU too)
                self.constants[i] = value.detach().to(_CPU, copy=True)
            self.written.add(self.group_of[i])
        return self.refs[i]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        named: list[torch.device] = []
        if kwargs:
            kwargs = map_leaves(functools.partial(self._on_build_device, named), kwargs)
        args = map_leaves(functools.partial(self._on_build_device, named), args)
        if func is _READ_SCALAR:
            return self._read_scalar(func, args)
        out = func(*args, **kwargs)
        # Inputs before outputs: an in-place operation returns its input, which must
        # have been made before (`_input`).
        self.func = func
        op = Op(func, map_leaves(self._input, args), map_leaves(self._input, kwargs) if kwargs else {},
                map_leaves(self._output, out), named_device=named[0] if named else None)
        if draws_random_numbers(func):
            with _disable_current_modes():  # real tensors, compared outside the fake mode
                state = torch.get_rng_state()
                if not torch.equal(state, self.rng_state):
                    op.rng_state = self.rng_state = state
        self.ops.append(op)
        self._note_writes(func, args, op)
        return out

    def _read_scalar(self, func: Any, args: tuple[Any, ...]) -> Any:
        """``.item()`` (and ``int()``, ``bool()``, ``tolist()``) of a tensor: fake and meta
        tensors hold no value, so a value the tape can compute from constants and
        factories alone is computed (`annot.meta.value_reads`); any other read fails as
        it would have. Nothing is recorded: the read makes no tensor."""
        try:
            return func(*args)
        except Exception as exc:
            i = self.index.get(id(args[0]))
            with _disable_current_modes():  # real tensors, outside the fake mode
                value = (None if i is None else
                         value_of(i, self.ops, self.constants, self.group_of, self.layout))
                if value is not None:
                    return value.item()
            raise DeferredInitError(
                "the constructor reads a tensor's value (.item(), int(), bool()) that a "
                "deferred build cannot know: it depends on random numbers or on a tensor of "
                f"more than {VALUE_READ_LIMIT} elements (a weight). Build this model eagerly, "
                "or compute the value from Python numbers in its constructor") from exc

    def _on_build_device(self, named: list[torch.device], x: Any) -> Any:
        """A device argument other than the build device and the CPU becomes the build
        device; the one named is appended to ``named``. Everything else passes unchanged
        (on the meta device a tensor the constructor makes on the CPU stays real, as
        before: the record keeps it as a constant)."""
        if isinstance(x, torch.device) and x.type not in (self.build_device.type, "cpu"):
            named.append(x)
            return self.build_device
        return x

    def _input(self, x: Any) -> Any:
        """An argument as the tape holds it. On the meta device, a meta tensor no recorded
        operation made (built before the block, or by a path that dispatches nothing)
        has no value the replay could start from: refused."""
        if isinstance(x, torch.Tensor):
            ref = self.ref(x)
            if self.on_meta_device and ref.index not in self.made and ref.index not in self.constants:
                raise DeferredInitError(
                    f"{self.func} reads a meta tensor that no recorded operation made: its "
                    "value cannot be replayed")
            return ref
        if self.on_meta_device and isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    def _output(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            ref = self.ref(x)
            self.made.add(ref.index)
            return ref
        return x

    def _note_writes(self, func: Any, args: tuple[Any, ...], op: Op) -> None:
        written_args, fresh_returns = writes_of(func)
        for position in written_args:
            if position < len(args) and isinstance(value := args[position], torch.Tensor):
                self.written.add(self.group_of[self.index[id(value)]])
        if func not in UNINITIALIZED:
            for fresh, ref in zip(fresh_returns, leaves(op.out), strict=False):
                if fresh and isinstance(ref, Ref):
                    self.written.add(self.group_of[ref.index])


_CPU = torch.device("cpu")
_READ_SCALAR = torch.ops.aten._local_scalar_dense.default
_registered_inits: dict[type, Callable[[nn.Module], None]] = {}


def register_init(cls: type[nn.Module], fn: Callable[[nn.Module], None]) -> None:
    """Tell `meta_init` how to initialize modules of ``cls`` whose constructor leaves
    their parameters empty and that have no ``reset_parameters``."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_init() takes an nn.Module class, not {cls!r}")
    _registered_inits[cls] = fn


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Construct models inside this block without allocating; see the module docstring.

    Every ``nn.Module`` whose construction *finishes* inside the block and that is not
    part of another one built there gets the record attached; pass it to
    `annot.materialize` (or `annot.auto_wrap`) to give it real values.
    """
    with _recording(FakeTensorMode(allow_non_fake_inputs=True), _Recorder()):
        yield


@contextlib.contextmanager
def meta_device_init() -> Iterator[None]:
    """`meta_init` on the meta device instead of fake CPU tensors: 2-3x faster to build,
    but code that skips initialization on the meta device (transformers' ``_init_weights``)
    skips it here too, so the record holds only what the constructors compute themselves
    (``nn.Linear``'s own init, rotary frequencies). Right only for a model whose
    checkpoint supplies every persistent tensor, and only if nothing computes a buffer
    differently on the meta device (`annot.from_pretrained` checks the first and falls
    back to `meta_init` otherwise; docs/design.md, pitfall 29)."""
    with _recording(_AllFactoriesOn(torch.device("meta")), _Recorder(on_meta_device=True)):
        yield


class _AllFactoriesOn(TorchFunctionMode):
    """Every tensor factory builds on ``device`` unless its call names the CPU.

    ``with torch.device("meta")`` sets only a device the call leaves out: a constructor
    naming ``device="cuda"`` (or opening its own ``with torch.device("cuda")``, which
    replaces the outer one) would allocate on the GPU, or fail without one, before the
    recorder could send it to the meta device. This mode sits above torch's device
    context and names ``device`` on every call, so the context never adds its own. A
    call that names the CPU keeps it, as under ``torch.device("meta")``: its tensor is
    real, and the record keeps its value as a constant."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        named = kwargs.get("device")
        if func in _device_constructors() and (named is None or torch.device(named).type != "cpu"):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextlib.contextmanager
def _recording(tensor_mode: contextlib.AbstractContextManager[Any], recorder: _Recorder) -> Iterator[None]:
    """The body of both: record under ``tensor_mode``, then swap in meta tensors."""
    global _active
    if _active:
        raise DeferredInitError(
            "annot.meta_init() blocks do not nest: build everything in one block (a model "
            "and the adapters or heads added to it), or close the first block before the next")
    rng_state = torch.get_rng_state()
    built: list[nn.Module] = []
    original_call = _capture_roots(built)
    _active = True
    try:
        with _value_dependent_inits(tensor_mode), _noop_to_returns_self(), _fake_deepcopy_clones(), \
                tensor_mode, recorder:
            yield
            for root in _roots(built):
                _init_untouched(root, recorder)
    finally:
        _active = False
        _release_capture(original_call)
    for root in _roots(built):
        _to_meta(root, recorder, rng_state)


def _value_dependent_inits(tensor_mode: object) -> contextlib.AbstractContextManager[Any]:
    """Fake tensors need value-dependent init functions routed to opaque operators
    (`annot.meta.opaque_init`); on the meta device those fail with or without it
    (`annot.from_pretrained` then builds on fake tensors). Imported only when needed:
    registering the operator took 0.04-0.06 s of a first meta-device build (profiled)."""
    if not isinstance(tensor_mode, FakeTensorMode):
        return contextlib.nullcontext()
    from annot.meta.opaque_init import opaque_inits

    return opaque_inits()


def build(cls: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """``annot.build(GPT, config)``: construct under `meta_init` and return the model."""
    with meta_init():
        model = cls(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"build() constructs nn.Modules; {cls!r} returned {type(model).__name__}")
    return model


def deferred_init_of(model: nn.Module) -> DeferredInit | None:
    """The record `meta_init` attached to ``model``, or to the model an engine's root
    wrapper (FSDP1, DDP) holds as its only child; ``None`` if there is none."""
    state = peek_state(model)
    child = next(iter(model._modules.values())) if len(model._modules) == 1 else None
    if state is None and child is not None:
        state = peek_state(child)
    construction = state.construction if state is not None else None
    return construction if isinstance(construction, DeferredInit) else None


_active = False  # inside a meta_init block (they do not nest: one record per block)


@contextlib.contextmanager
def _noop_to_returns_self() -> Iterator[None]:
    """``module.to(...)`` that would change no tensor returns the module untouched.

    Under FakeTensorMode, ``nn.Module._apply`` swaps every parameter for its converted
    copy, and a conversion that changes nothing (PEFT moving new adapters "to the base
    layer's device and dtype") fails to swap a parameter with itself. Eager torch changes
    nothing there either, so skipping it keeps the construction exactly eager's."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
                (device is None or t.device == torch.device(device))
                and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                for t in tensors):
            return self
        if memory_format is None and any(isinstance(t, FakeTensor) for t in tensors):
            # A real conversion (PEFT casting new adapters to a bfloat16 base's dtype):
            # `_apply` would swap each fake parameter with its copy, which the record's
            # weak references forbid. Each tensor is converted (a recorded operation)
            # and put in its place instead, a new Parameter as `to` gives without swaps.
            _convert_in_place(self, device, dtype)
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


def _convert_in_place(module: nn.Module, device: Any, dtype: torch.dtype | None) -> None:
    """Every parameter and buffer of ``module`` converted to ``device`` and (floating and
    complex ones) ``dtype``, each put back in its module's dict."""
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and (tensor.is_floating_point() or tensor.is_complex()) else None
        return tensor.to(device=device, dtype=cast)

    with torch.no_grad():
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None:
                    owner._parameters[name] = nn.Parameter(convert(param), requires_grad=param.requires_grad)
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = convert(buffer)


@contextlib.contextmanager
def _fake_deepcopy_clones() -> Iterator[None]:
    """``copy.deepcopy`` of a fake tensor inside the block is a recorded ``clone``.

    FakeTensor answers ``Tensor.__deepcopy__`` with ``fake_mode.from_tensor(t)``, which
    records nothing the replay could follow, and copying a module that holds fake
    parameters (PEFT's ``modules_to_save`` copies the embedding or head it trains)
    corrupted the process's heap: later allocations aborted ("corrupted double-linked
    list") or crashed, and a loaded embedding held other memory's bytes, within one
    process (docs/design.md, pitfall 54). A clone is what eager ``deepcopy`` computes,
    and the recorder replays it from the source's values."""
    had = "__deepcopy__" in FakeTensor.__dict__
    previous = FakeTensor.__dict__.get("__deepcopy__")

    def deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            out = torch.Tensor.clone(self)
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    FakeTensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            FakeTensor.__deepcopy__ = previous  # type: ignore[method-assign,assignment]
        else:
            del FakeTensor.__deepcopy__


# Which modules were built: wrap nn.Module.__init__ for the duration of the block.
def _capture_roots(built: list[nn.Module]) -> Callable[..., None]:
    original = nn.Module.__init__

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    nn.Module.__init__ = __init__  # type: ignore[method-assign]
    return original


def _release_capture(original: Callable[..., None]) -> None:
    nn.Module.__init__ = original  # type: ignore[method-assign]


def _roots(built: list[nn.Module]) -> list[nn.Module]:
    """Modules built in the block that are not inside another one built there, in the
    order they were built. A module finishes construction after the modules it makes, so
    walking from the last built, each root's tree is walked once and what it holds is
    skipped (walking every module's tree was quadratic in the depth: profiled)."""
    inside: set[int] = set()
    roots: set[int] = set()
    for module in reversed(built):
        if id(module) in inside or id(module) in roots:
            continue
        for child in module.modules():
            if child is not module:
                inside.add(id(child))
                roots.discard(id(child))  # built after this one and put in it later
        roots.add(id(module))
    out, seen = [], set()
    for module in built:
        if id(module) in roots and id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    return out


def _init_untouched(root: nn.Module, recorder: _Recorder) -> None:
    """Run ``reset_parameters`` (or a registered init) for modules whose constructor left
    their own parameters unwritten, still under the recorder so it lands on the tape."""
    for module in root.modules():
        own = list(module.parameters(recurse=False))
        if not own or all(recorder.group_of[recorder.ref(p).index] in recorder.written for p in own):
            continue
        init = next((fn for cls, fn in _registered_inits.items() if isinstance(module, cls)), None)
        if init is not None:
            init(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()


def _to_meta(root: nn.Module, recorder: _Recorder, rng_state: torch.Tensor) -> None:
    """Swap fake tensors for meta ones (one new object per old one: ties stay ties) and
    attach the record."""
    tensors: dict[str, int] = {}
    module_of: dict[str, str] = {}
    replacement: dict[int, torch.Tensor] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for kind in ("_parameters", "_buffers"):
            holder = getattr(module, kind)
            for name, t in list(holder.items()):
                if t is None:
                    continue
                tensors[prefix + name] = recorder.ref(t).index
                module_of[prefix + name] = path
                if id(t) not in replacement:
                    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    if kind == "_parameters":
                        meta = nn.Parameter(meta, requires_grad=t.requires_grad)
                    replacement[id(t)] = meta
                holder[name] = replacement[id(t)]
    attributes: dict[str, int] = {}

    def attribute_to_meta(name: str, t: torch.Tensor) -> torch.Tensor:
        index = recorder.index.get(id(t))
        # Only what the record can compute; a real tensor from outside stays as it is.
        if not (isinstance(t, FakeTensor) or t.is_meta) or index is None or id(t) in replacement \
                or (index not in recorder.made and index not in recorder.constants):
            return t
        attributes[name] = index
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    map_tensor_attributes(root, attribute_to_meta)
    module_state(root).construction = DeferredInit(
        ops=recorder.ops,
        rng_state=rng_state,
        constants=recorder.constants,
        group_of=recorder.group_of,
        written=recorder.written,
        tensors=tensors,
        module_of=module_of,
        layout=recorder.layout,
        on_meta_device=recorder.on_meta_device,
        attributes=attributes,
    )
