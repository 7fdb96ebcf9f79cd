"""Activation memory, traced rather than guessed.

One forward runs under ``FakeTensorMode`` (shapes and dtypes only: no data, no real
memory, so a 70B config traces in seconds) with autograd's saved-tensor hooks counting
what backward will keep: every distinct storage saved for backward, parameters
excluded. Fake tensors stay on the CPU device so the same kernels (and so the same
saved tensors) are chosen as in a real CPU run; on a GPU, attention kernels may save
less (flash attention keeps no probability matrix). `trace_step(gpu_rules=True)` (what
`estimate_memory` uses) casts by CUDA autocast's op lists instead of the CPU's
(`annot.memory.gpu_autocast`).

Checkpointed units (the Plan's ``checkpoint`` action) are accounted from the same
trace: their interior is dropped and only their inputs are kept, and backward
recomputes one unit at a time, which adds that unit's interior as a transient peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map

from annot.huggingface.model import cache_off_in_training
from annot.memory.counting import storage_key
from annot.memory.inputs import InputsFn, default_inputs, step_inputs
from annot.memory.routing_values import ValueShadows, reads_values
from annot.policies import Action, Plan

__all__ = ["ActivationEstimate", "InputsFn", "default_inputs", "trace_activations"]

OUTSIDE = ""  # attribution of tensors saved outside every checkpointed unit


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward at one (batch, seq).

    ``saved``: no checkpointing. ``saved_checkpointed``: with the Plan's checkpointing.
    ``recompute_peak``: the largest interior of one checkpointed unit, alive while backward
    recomputes it. ``per_unit``: interior bytes of each checkpointed unit.
    """

    batch: int
    seq: int
    saved: int
    saved_checkpointed: int
    recompute_peak: int
    per_unit: dict[str, int]
    #: What the trace assumed of values it could not know (`annot.memory.routing_values`:
    #: `ROUTING_ASSUMPTION` or `INPUT_ASSUMPTION`), or "": printed with the table.
    assumption: str = ""

    @property
    def checkpointed_peak(self) -> int:
        return self.saved_checkpointed + self.recompute_peak


def trace_activations(
    model: nn.Module,
    plan: Plan | None,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype | None = None,
    inputs: InputsFn | None = None,
) -> ActivationEstimate:
    """Trace one training-mode forward of ``model`` (any device, meta included; it is not
    modified) at
    ``batch`` x ``seq`` and count the bytes saved for backward, with and without the
    checkpointing in ``plan``. ``dtype`` casts floating parameters first (the compute
    dtype of mixed precision). A model that reads values is traced under balanced routing
    (`annot.memory.routing_values`; ``assumption`` says so)."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be at least 1, got batch={batch}, seq={seq}")
    return _with_values(lambda shadows: _trace_activations(model, plan, batch=batch, seq=seq, dtype=dtype,
                                                           inputs=inputs, shadows=shadows))


def _trace_activations(model: nn.Module, plan: Plan | None, *, batch: int, seq: int,
                       dtype: torch.dtype | None, inputs: InputsFn | None,
                       shadows: ValueShadows | None) -> ActivationEstimate:
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = shadows if shadows is not None else contextlib.nullcontext()
    checkpointed = set(plan.paths(Action.CHECKPOINT)) if plan is not None else set()
    modules = dict(model.named_modules())
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        # One entry per parameter: functional_call re-ties tied names itself.
        params = {name: _fake_like(t, dtype, is_param=True) for name, t in model.named_parameters()}
        buffers = {name: _fake_like(t, dtype, is_param=False) for name, t in model.named_buffers()}
        # The inputs are built against the fake parameters (a builder that runs the
        # tower to count its tokens, LLaVA's, needs them: the model's own are meta).
        with values, _reparametrize_module(model, {**params, **buffers}, tie_weights=True, strict=False):
            args, kwargs, _ = step_inputs(inputs, model, batch, seq)
        args, kwargs = _cast_inputs((args, kwargs), dtype)
    state = {**params, **buffers}
    param_keys = {storage_key(t) for t in params.values()}  # model states, not activations

    # Which checkpointed unit is running (innermost), and what each saved storage costs
    # and who saved it.
    active: list[str] = []
    sizes: dict[int, int] = {}
    savers: dict[int, set[str]] = {}
    unit_inputs: dict[str, set[int]] = {path: set() for path in checkpointed}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in param_keys:
            sizes[key] = t.untyped_storage().nbytes()
            savers.setdefault(key, set()).add(active[-1] if active else OUTSIDE)
        return t

    def enter(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            active.append(path)
            # Nested too: decoder layers take (cos, sin) tuples, caches, ...
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    key = storage_key(value)
                    sizes.setdefault(key, value.untyped_storage().nbytes())
                    unit_inputs[path].add(key)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        active.pop()

    # Training mode (dropout masks are saved too); each module's own mode comes back after.
    modes = {m: m.training for m in modules.values()}
    model.train()
    handles = []
    for path in checkpointed:
        handles.append(modules[path].register_forward_pre_hook(enter(path), with_kwargs=True))
        handles.append(modules[path].register_forward_hook(leave))
    try:
        with fake_mode, values, _traceable(), _tensor_attributes_kept(model), \
                _fake_tensor_attributes(model, fake_mode), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training

    saved = sum(sizes[k] for k in savers)
    per_unit = {
        path: sum(sizes[k] for k, who in savers.items() if path in who) for path in sorted(checkpointed)
    }
    # Kept with checkpointing: whatever something outside a checkpointed unit saved,
    # plus each checkpointed unit's inputs (held for the recomputation).
    kept = {k for k, who in savers.items() if OUTSIDE in who}
    for keys in unit_inputs.values():
        kept |= keys - param_keys
    return ActivationEstimate(
        batch=batch,
        seq=seq,
        saved=saved,
        saved_checkpointed=sum(sizes[k] for k in kept) if checkpointed else saved,
        recompute_peak=max(per_unit.values(), default=0),
        per_unit=per_unit,
        assumption=shadows.assumption if shadows is not None else "",
    )


R = TypeVar("R")


def _with_values(trace: Callable[[ValueShadows | None], R]) -> R:
    """``trace(None)``; where the model reads a value that fails, ``trace`` again with
    `ValueShadows` (balanced routing). Models that read no value trace exactly as before."""
    try:
        return trace(None)
    except Exception as exc:
        if not reads_values(exc):
            raise
    return trace(ValueShadows())


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None, *, is_param: bool) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s shape (``t`` may live on the meta device)."""
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(t.shape, t.stride(), dtype=target, device="cpu")
    if is_param and t.requires_grad and fake.is_floating_point():
        fake.requires_grad_(True)
    return fake


@dataclasses.dataclass(frozen=True)
class SegmentCounts:
    """What `trace_step` counted over one stretch of `StepTrace.segments`: the most live
    bytes with the parameters' gradients (``top_all``; the stretch's share of
    ``peak_with_grads``), and the gradients' bytes and the FLOPs since the step began
    when the stretch ends."""

    top_all: int
    grads: int
    flops: int


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """Live bytes of one traced forward and backward of the bare model (its parameters
    not counted), at the peak: ``peak`` without the parameters' gradients (an engine that
    moves each gradient away as it is produced: DDP's bucket views, ZeRO's reduce
    buckets, FSDP's reduce-scatter) and ``peak_with_grads`` with them (an engine that
    keeps every gradient until the optimizer step). ``grads``: all gradients' bytes."""

    batch: int
    seq: int
    checkpoint: bool
    peak: int
    peak_with_grads: int
    grads: int
    #: In order: (phase, unit, the most live bytes without parameter gradients, those
    #: bytes when the stretch ends) for each stretch where one shard unit runs (index
    #: into ``units``; -1: outside every unit) in ``"forward"`` (recomputation included)
    #: or ``"backward"``; what an engine gathers depends on the unit and phase
    #: (`annot.memory.engine_memory`).
    segments: tuple[tuple[str, int, int, int], ...] = ()
    #: Floating-point operations of the traced step (forward, loss, backward, and the
    #: recomputation of checkpointed units; `annot.memory.counting.FlopCount`).
    flops: int = 0
    #: As `ActivationEstimate.assumption`.
    assumption: str = ""
    #: The share of the gradient elements of parameters outside every shard unit that
    #: backward makes only after it has left the last unit (an embedding's: it is used
    #: first, so its gradient comes last); the others (a head's) exist from the first
    #: backward stretch on (FSDP's root keeps them unsharded until backward ends).
    root_grads_last: float = 0.0


def trace_step(
    model: nn.Module,
    plan: Plan | None,
    *,
    batch: int,
    seq: int,
    checkpoint: bool,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    inputs: InputsFn | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    gpu_rules: bool = False,
    counts: list[SegmentCounts] | None = None,
    float8_gathered: bool = False,
) -> StepTrace:
    """Trace forward, loss and backward of ``model`` under ``FakeTensorMode`` and count live
    bytes with `annot.memory.counting.LiveBytes`: activations, the transients of
    backward (gradients of activations, the loss's), and the parameters' gradients as
    autograd produces them. ``checkpoint`` runs the Plan's checkpointed units under
    torch's non-reentrant checkpoint, as `auto_wrap` does; ``dtype`` casts floating
    parameters (a 16-bit compute copy), ``autocast`` traces under ``torch.autocast``, or
    with ``gpu_rules`` under CUDA autocast's op lists (`annot.memory.gpu_autocast`).
    Only the loss is kept from the output (what a training step holds in backward).
    ``prepare`` installs the run-time tools on the traced copy instead of the Plan's
    checkpointing (`annot.memory.budget` traces its per-unit choices so). ``counts``,
    when given, receives one `SegmentCounts` per stretch of the returned ``segments``
    (`annot.memory.representative` rebuilds a whole step from a cut one with them).
    ``float8_gathered``: the Plan's float8 linears get their weights as FSDP2's float8
    all-gather gives them, cast once (`annot.float8.as_gathered_in_float8`). A model that
    reads values is traced under balanced routing (`trace_activations`)."""
    def run(shadows: ValueShadows | None) -> StepTrace:
        found: list[SegmentCounts] = []
        trace = _trace_step(model, plan, batch=batch, seq=seq, checkpoint=checkpoint, dtype=dtype,
                            autocast=autocast, inputs=inputs, prepare=prepare, gpu_rules=gpu_rules,
                            counts=found, shadows=shadows, float8_gathered=float8_gathered)
        if counts is not None:
            counts.extend(found)
        return trace
    return _with_values(run)


def _trace_step(model: nn.Module, plan: Plan | None, *, batch: int, seq: int, checkpoint: bool,
                dtype: torch.dtype | None, autocast: torch.dtype | None, inputs: InputsFn | None,
                prepare: Callable[[nn.Module], None] | None, gpu_rules: bool,
                counts: list[SegmentCounts], shadows: ValueShadows | None,
                float8_gathered: bool = False) -> StepTrace:
    from annot.memory.counting import FlopCount, LiveBytes
    from annot.runtime.activation_checkpoint import apply_checkpointing, torch_checkpoint

    paths = plan.paths(Action.CHECKPOINT) if plan is not None and checkpoint else []
    model, fake_mode = fake_copy(model, dtype)
    if plan is not None and plan.paths(Action.FLOAT8):
        # The float8 linears as auto_wrap makes them: their casts, scales and what they
        # save for backward (a float8 copy of the input where the recipe keeps one) are
        # traced and counted like any other tensor.
        from annot.float8 import apply_float8, as_gathered_in_float8

        apply_float8(model, plan, log=False)
        if float8_gathered:
            as_gathered_in_float8(model)
    if prepare is not None:
        prepare(model)
    else:
        # Under CUDA's rules a recomputation must cast as its forward did: torch's
        # checkpoint restores torch.autocast for it, not a function mode, so the rules
        # enter with it.
        checkpoint_fn = _recompute_under_rules(autocast) if gpu_rules and autocast else torch_checkpoint

        def marked(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return checkpoint_fn(_marking_recomputation(function), *args, **kwargs)
        apply_checkpointing(model, paths, marked)
    params = dict(model.named_parameters())
    grads: dict[int, int] = {}
    root_grads: dict[int, tuple[int, int]] = {}  # id -> (stretch its gradient came in, elements)
    peaks = {"act": 0, "all": 0, "grads": 0}  # grads: the running sum of ``grads``
    # Which shard unit runs: forward (pre-)hooks; in backward the unit a gradient of whose
    # outputs was just computed (backward enters it), the unit being recomputed (its
    # parameters are gathered for it: the stretch is the unit's, not the one before) and
    # the unit whose parameter last got its gradient.
    shard_paths = [u.modules for u in plan.units if u.has(Action.SHARD)] if plan is not None else []
    unit_of: dict[int, int] = {}
    for index, modules in enumerate(shard_paths):
        for path in modules:
            for p in model.get_submodule(path).parameters():
                unit_of.setdefault(id(p), index)
    state: dict[str, Any] = {"phase": "forward", "unit": -1}
    segments: list[list[Any]] = [["forward", -1, 0, 0]]
    # Per stretch: [top with gradients, gradients at its end, FLOPs at its end].
    tallies: list[list[int]] = [[0, 0, 0]]
    flop_counter = FlopCount()

    def close() -> None:
        tallies[-1][1:] = [peaks["grads"], flop_counter.total]

    def at(phase: str, unit: int) -> None:
        state["phase"], state["unit"] = phase, unit
        if segments[-1][:2] != [phase, unit]:
            close()
            act = counter.current - peaks["grads"]
            segments.append([phase, unit, act, act])
            tallies.append([counter.current, 0, 0])

    def _marking_recomputation(function: Callable[..., Any]) -> Callable[..., Any]:
        # ``function``: a checkpointed module's bound forward; called again in backward.
        module = getattr(function, "__self__", None)
        owner = next(module.parameters(), None) if isinstance(module, nn.Module) else None

        def run(*args: Any, **kwargs: Any) -> Any:
            if state["phase"] == "backward" and owner is not None:
                at("backward", unit_of.get(id(owner), state["unit"]))
            return function(*args, **kwargs)
        return run

    def on_change(current: int) -> None:
        act = current - peaks["grads"]
        peaks["all"] = max(peaks["all"], current)
        peaks["act"] = max(peaks["act"], act)
        segments[-1][2] = max(segments[-1][2], act)
        segments[-1][3] = act
        tallies[-1][0] = max(tallies[-1][0], current)

    counter = LiveBytes(on_change)
    handles = []
    for kept in (*params.values(), *model.buffers()):
        counter.exclude(kept)
    for p in params.values():
        if p.requires_grad:
            def hook(param: torch.Tensor) -> None:
                assert param.grad is not None
                nbytes = counter.bytes_of(param.grad)
                peaks["grads"] += nbytes - grads.get(id(param), 0)
                grads[id(param)] = nbytes
                at("backward", unit_of.get(id(param), -1))
                if id(param) not in unit_of:
                    root_grads[id(param)] = (len(segments) - 1, param.numel())
            handles.append(p.register_post_accumulate_grad_hook(hook))

    def _entering(index: int, grad: torch.Tensor) -> None:
        at("backward", index)

    for index, modules in enumerate(shard_paths):
        for path in modules:
            def pre(module: nn.Module, args: Any, index: int = index) -> None:
                at(state["phase"], index)

            def post(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
                # Backward enters the unit when a gradient of one of its outputs is ready:
                # FSDP2, FSDP1 and ZeRO-3 gather the unit's parameters (and prefetch the
                # next unit's) there, before its first operation's backward runs.
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(functools.partial(_entering, index))
                if state["phase"] == "forward":
                    at("forward", -1)
            handles.append(model.get_submodule(path).register_forward_pre_hook(pre))
            handles.append(model.get_submodule(path).register_forward_hook(post))
    modes = {m: m.training for m in model.modules()}
    model.train()
    try:
        # The shadows sit between the fake mode and the counters: what they make is counted.
        # A training step keeps no key/value cache, checkpointed or not (pitfall 14).
        with fake_mode, shadows if shadows is not None else contextlib.nullcontext(), \
                counter, flop_counter, _traceable(), cache_off_in_training(model):
            args, kwargs, loss_of = step_inputs(inputs, model, batch, seq)
            args, kwargs = _cast_inputs((args, kwargs), dtype)
            rules = _gpu_rules(autocast) if gpu_rules else None
            with rules if rules is not None else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None and rules is None):
                    out = model(*args, **kwargs)
                    loss = loss_of(out)
            del out
            at("backward", -1)
            loss.backward()
            del loss
        close()
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    counts.extend(SegmentCounts(*t) for t in tallies)
    last_unit = max((i for i, (ph, u, _, _) in enumerate(segments) if ph == "backward" and u >= 0), default=None)
    root_total = sum(n for _, n in root_grads.values())
    root_last = sum(n for i, n in root_grads.values() if last_unit is not None and i > last_unit)
    return StepTrace(batch=batch, seq=seq, checkpoint=bool(paths), peak=peaks["act"],
                     peak_with_grads=peaks["all"], grads=peaks["grads"],
                     segments=tuple((ph, u, top, end) for ph, u, top, end in segments),
                     flops=flop_counter.total, root_grads_last=root_last / root_total if root_total else 0.0,
                     assumption=shadows.assumption if shadows is not None else "")


def _cast_inputs(inputs: tuple[tuple[Any, ...], dict[str, Any]], dtype: torch.dtype | None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with every floating-point tensor in ``dtype`` when the trace
    casts the parameters to it (a 16-bit run): what FSDP2's and FSDP1's mixed precision
    do to a unit's forward inputs (``cast_forward_inputs``), DeepSpeed's 16-bit modes
    expect, and a 16-bit model needs (Whisper's mel features meet a bfloat16
    convolution). Token ids and masks are left as they are."""
    if dtype is None:
        return inputs
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    inputs)


def fake_copy(model: nn.Module, dtype: torch.dtype | None) -> tuple[nn.Module, Any]:
    """A deep copy of ``model`` holding fake CPU parameters and buffers itself (not
    through functional_call, whose swap is undone before backward recomputes a
    checkpointed unit; checkpointing swaps forwards on the copy's instances), and the
    ``FakeTensorMode`` they belong to. ``dtype`` casts floating ones."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from annot.meta.tensor_attributes import map_tensor_attributes

    model = copy.deepcopy(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes: dict[int, nn.Parameter] = {}
    with fake_mode:
        for module in model.modules():
            for name, t in list(module._parameters.items()):
                if t is not None:
                    if id(t) not in fakes:  # tied parameters stay one
                        fakes[id(t)] = nn.Parameter(_fake_like(t, dtype, is_param=False),
                                                    requires_grad=t.requires_grad)
                    module._parameters[name] = fakes[id(t)]
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = _fake_like(buf, dtype, is_param=False)
    map_tensor_attributes(model, lambda _, t: _fake_attribute(t, fake_mode))
    return model, fake_mode


def _fake_attribute(tensor: torch.Tensor, fake_mode: Any) -> torch.Tensor:
    """A plain tensor attribute (QwenImage's rotary tables, docs/design.md pitfall 62)
    as a fake tensor of ``fake_mode``, in its own dtype as ``model.to`` leaves it: a real
    one with its values, one on the meta device (or another fake mode's) by its shape."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor) and tensor.fake_mode is fake_mode:
        return tensor
    if tensor.is_meta or isinstance(tensor, FakeTensor):
        with fake_mode:
            return _fake_like(tensor, None, is_param=False)
    return fake_mode.from_tensor(tensor)


@contextlib.contextmanager
def _fake_tensor_attributes(model: nn.Module, fake_mode: Any) -> Iterator[None]:
    """``model``'s plain tensor attributes fake (`_fake_attribute`) inside, as they were
    after: a trace through ``functional_call`` swaps only parameters and buffers."""
    from annot.meta.tensor_attributes import map_tensor_attributes, tensor_attributes

    originals = tensor_attributes(model)
    map_tensor_attributes(model, lambda _, t: _fake_attribute(t, fake_mode))
    try:
        yield
    finally:
        map_tensor_attributes(model, lambda name, t: originals.get(name, t))


def _recompute_under_rules(dtype: torch.dtype) -> Callable[..., Any]:
    """A checkpoint function whose recomputation runs under CUDA's rules for ``dtype``
    (no cast cache: a recomputation casts again, as autocast on a GPU does)."""
    from torch.utils.checkpoint import checkpoint

    def recompute_context() -> tuple[Any, Any]:
        rules = _gpu_rules(dtype)
        rules.stop_caching()
        return contextlib.nullcontext(), rules

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, use_reentrant=False, context_fn=recompute_context, **kwargs)
    return run


def _gpu_rules(dtype: torch.dtype | None) -> Any:
    """CUDA autocast's casting rules for ``dtype`` (`annot.memory.gpu_autocast`), or
    ``None`` without autocast."""
    if dtype is None:
        return None
    from annot.memory.gpu_autocast import CudaAutocast

    return CudaAutocast(dtype)


@contextlib.contextmanager
def _traceable() -> Iterator[None]:
    """What a trace of a model's step needs besides fake tensors: `_torch_linear`,
    `_traceable_experts` and `_unpacked_sequences`."""
    with _torch_linear(), _traceable_experts(), _unpacked_sequences():
        yield


@contextlib.contextmanager
def _tensor_attributes_kept(model: nn.Module) -> Iterator[None]:
    """Leave ``model``'s modules as they were: a forward that stores a tensor on its
    module (RecurrentGemma's ``recurrent_states``) left a fake tensor with a graph on the
    user's model after a trace that runs on it (``functional_call``), and the next
    trace's deep copy of the model failed on it (issue #29's sweep). The same for the
    plain objects a module holds: Emu3's vocabulary mapping caches a tensor
    (``functools.cached_property``) built during the trace, and the next trace met that
    fake tensor from another fake mode ("Mixing fake modes", then a crash in the
    interpreter's cleanup; issue #42's sweep; ZImage's and Bria-Fibo-2's rotary
    embedders cache a list of tables). Any attribute holding tensors (`_holds_tensors`)
    the call sets or replaces is put back as it was (removed, or its old value)."""
    holders: list[Any] = list(model.modules())
    for module in list(holders):
        holders += [value for value in vars(module).values() if _plain_object(value)]
    before = {id(holder): (holder, dict(vars(holder))) for holder in holders}
    try:
        yield
    finally:
        for holder, attributes in before.values():
            for name, value in list(vars(holder).items()):
                if _holds_tensors(value) and attributes.get(name, None) is not value:
                    if name in attributes:
                        holder.__dict__[name] = attributes[name]
                    else:
                        del holder.__dict__[name]


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a list or tuple holding one (ZImage's rotary embedder caches a list of
    tables on its first forward, a fake one under a trace)."""
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))


def _plain_object(value: Any) -> bool:
    """An instance of a class of its own (not a module, tensor, container or type) with
    attributes a forward may cache tensors in."""
    # A callable instance counts (ZImage's rotary embedder is called, not a module);
    # functions and methods do not.
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not inspect.isroutine(value) and not isinstance(value, functools.partial)
            and type(value).__module__ != "builtins")


@contextlib.contextmanager
def _unpacked_sequences() -> Iterator[None]:
    """Tell transformers' masks that the traced batch holds no packed sequences, which is
    true of the trace's inputs (one sequence a row, positions 0 to seq-1). Without a
    key/value cache (``use_cache=False``, as training runs) transformers looks for packed
    sequences in the position ids; a real step finds none and lets SDPA mask causally,
    but under fake tensors the check is skipped (``is_tracing``) and a seq x seq mask is
    built and saved: the trace counted it in every attention call where the step has
    none. Applied only where transformers' masking module is already imported."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return
    setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(masking, "find_packed_sequence_indices", original)  # noqa: B010


@contextlib.contextmanager
def _torch_linear() -> Iterator[None]:
    """Trace with torch's own ``F.linear``. ``deepspeed.zero.Init`` (annot's ZeRO-3
    materialization calls it per unit) replaces ``torch.nn.functional.linear`` for the
    rest of the process with its memory-efficient autograd Function, whose forward does
    not compose with the CUDA autocast rules of the trace (`annot.memory.gpu_autocast`:
    the linear's matmul failed on a transposed weight's shape). A plan made in the same
    process after a ZeRO-3 run raised where a fresh process succeeds; the trace models
    a step as torch runs it, so it puts torch's function back for its duration."""
    import torch.nn.functional as F  # noqa: N812 (torch's own spelling)

    original = torch._C._nn.linear
    current = F.linear
    if current is original or not getattr(current, "__module__", "").startswith("deepspeed"):
        yield
        return
    F.linear = original
    try:
        yield
    finally:
        F.linear = current


@contextlib.contextmanager
def _traceable_experts() -> Iterator[None]:
    """Let transformers' fused mixture-of-experts layers run under ``FakeTensorMode`` in
    any dtype. torch's shape function for ``_grouped_mm`` (torch/_meta_registrations.py)
    carries the CUDA kernel's bf16-only check, while the CPU kernel transformers calls
    takes fp32 too, so a fp32 trace of Mixtral, Qwen3-MoE or gpt-oss failed. For weights
    other than bf16, transformers' own grouped-matmul fallback op is used instead: it has
    a shape function for every dtype and saves the same tensors for backward (the
    tokens and the expert weights), so the count is unchanged. Applied only where
    transformers' MoE module is already imported; a transformers without the private
    helper traces as before."""
    moe = sys.modules.get("transformers.integrations.moe")
    original = getattr(moe, "_can_use_grouped_mm", None)
    if moe is None or original is None:
        yield
        return

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    setattr(moe, "_can_use_grouped_mm", can_use)  # noqa: B010 (a module typed without it)
    try:
        yield
    finally:
        setattr(moe, "_can_use_grouped_mm", original)  # noqa: B010


