"""What a quantized frozen base (QLoRA, ``quantize="nf4"``) costs the planner.

A quantized weight is priced by what it holds, not by the dtype it reports: torchao's
``NF4Tensor`` keeps packed 4-bit codes, one 8-bit scale per 64 weights and one factor
per 256 scales, about 0.52 bytes a weight; FSDP2 shards and all-gathers those bytes.
Each use (forward, and backward for the input's gradient) dequantizes the whole weight
first, and that transient is far from the weight's own size: torchao unpacks the codes
through int64 indices, measured here at 20 bytes a weight in fp32 and 14 in bf16 at its
peak, so a 8192 x 28672 MLP weight of a 70B model passes through 3.3 GB in bf16.

The stored bytes go into the engines' terms (`annot.memory.engine_memory.ModelFacts`);
the transient goes into the traced step itself (`dequantization_in_trace`), at each
quantized linear's forward (a recomputation's too) and backward, so it adds to what is
live at that moment rather than to the step's peak wherever that is.

Both figures are counted, not assumed: `nf4_costs` quantizes a small real weight with
torchao and counts, with `LiveBytes`, what it holds and the peak of one dequantization
(linear in the weight's size: both are per-block work). A torchao that changes its
layout or its dequantization changes the figures with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["QUANTIZED_KEYS", "QuantizedBase", "QuantizedCosts", "dequantization_in_trace",
           "from_pretrained_call", "nf4_costs", "priced_base", "quantized_base", "quantized_weights"]

#: The planner's rows that train a quantized base: DDP, and FSDP2 on one mesh dimension.
QUANTIZED_KEYS = ("ddp", "fsdp2-no-reshard", "fsdp2", "fsdp2-offload")

#: The weight `nf4_costs` measures on: 256 x 1024 weights, 16 whole blocks of 64 x 256.
_PROBE_SHAPE = (256, 1024)


@dataclasses.dataclass(frozen=True)
class QuantizedCosts:
    """Bytes per quantized weight: ``stored`` (packed codes and scales, what FSDP2 shards
    and gathers) and ``dequantize`` (the peak of dequantizing it once, transient)."""

    stored: float
    dequantize: float


@functools.cache
def nf4_costs(dtype: torch.dtype) -> QuantizedCosts:
    """Count torchao's NF4 on a real 256 x 1024 weight of ``dtype`` (needs torchao)."""
    from annot.memory.counting import LiveBytes
    from annot.quantization import BLOCK, SCALER_BLOCK, nf4_tensor_type

    _, to_nf4 = nf4_tensor_type()
    weight = torch.randn(_PROBE_SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        quantized = to_nf4(weight, BLOCK, SCALER_BLOCK)
        counter = LiveBytes()
        with counter:
            counter.reset_peak()
            quantized.get_original_weight()
    stored = sum(getattr(quantized, part).nbytes
                 for part in ("quantized_data", "quantized_scalers", "quantization_factor"))
    return QuantizedCosts(stored=stored / weight.numel(), dequantize=counter.peak / weight.numel())


def quantized_weights(model: nn.Module, names: Collection[str]) -> set[int]:
    """The ids of ``model``'s parameters named ``names`` (state names, as
    `annot.quantization.choose_linears` gives them)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    missing = [name for name in names if name not in parameters]
    if missing:
        raise KeyError(f"no parameter named {missing[0]!r} in {type(model).__name__}")
    return {id(parameters[name]) for name in names}


@dataclasses.dataclass(frozen=True)
class QuantizedBase:
    """The weights a quantized base holds quantized (parameter ids), what each costs,
    and the sentence the report says about them."""

    format: str
    weights: frozenset[int]
    costs: QuantizedCosts
    said: str

    def facts_options(self) -> dict[str, Any]:
        """`annot.memory.engine_memory.model_facts`'s keywords for this base."""
        return {"quantized": self.weights, "quantized_costs": self.costs}


def priced_base(model: nn.Module, quantize: str | None, precision: str, world: int,
                unquantized: Any = None) -> QuantizedBase | None:
    """`quantized_base` for the planner's ``quantize=`` option: ``None`` when it is
    ``None``, and ``unquantized`` refused without it."""
    from annot.memory.strategies import MemoryInputError

    if quantize is None:
        if unquantized is not None:
            raise MemoryInputError("unquantized= goes with quantize='nf4'")
        return None
    return quantized_base(model, quantize, precision, world, unquantized)


def quantized_base(model: nn.Module, quantize: str, precision: str, world: int,
                   unquantized: Any = None) -> QuantizedBase:
    """The quantized base of ``model`` (unwrapped, meta is fine; its base frozen, as
    PEFT leaves it) when ``annot.from_pretrained(..., quantize=quantize)`` loads it on
    ``world`` ranks; stored in bf16 for ``precision="bf16"``, else in fp32 (the dtype
    the weights dequantize to: FSDP2's mixed precision does not cast them). ``unquantized``:
    as `annot.quantization.choose_linears` takes it."""
    from annot.memory.strategies import MemoryInputError
    from annot.quantization import FORMATS, choose_linears

    if quantize not in FORMATS:
        raise MemoryInputError(f"quantize={quantize!r}: the planner prices {', '.join(map(repr, FORMATS))}")
    linears = choose_linears(model, world, unquantized)
    if not linears.quantized:
        raise MemoryInputError("quantize='nf4' quantizes frozen linears, and this model has none that "
                               "can be: freeze its base (a PEFT model) first")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    costs = nf4_costs(dtype)
    weights = quantized_weights(model, linears.quantized)
    said = (f"quantized base: {len(weights)} linear weights in NF4 at {costs.stored:.3f} bytes a "
            f"weight; dequantizing one peaks at {costs.dequantize:.1f} bytes a weight in "
            f"{str(dtype).removeprefix('torch.')} (both counted on torchao); DDP and FSDP2 rows only")
    return QuantizedBase(quantize, frozenset(weights), costs, said)


@contextlib.contextmanager
def dequantization_in_trace(model: nn.Module, base: QuantizedBase | None) -> Iterator[None]:
    """While active, each module of ``model`` whose weight ``base`` quantizes allocates
    and frees its dequantization transient (``numel x costs.dequantize`` bytes) just
    before its forward and as backward reaches its output, as torchao's NF4 linear
    dequantizes the weight for the output and again for the input's gradient: a traced
    step (`annot.memory.activations`, counting with `LiveBytes`) then counts it where it
    happens. Where the input needs no gradient (the first block's projections of a
    frozen embedding's output) backward allocates nothing, as the real one dequantizes
    nothing. Does nothing for ``base=None``."""
    if base is None:
        yield
        return
    handles = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and id(weight) in base.weights:
            nbytes = round(weight.numel() * base.costs.dequantize)
            handles.append(module.register_forward_pre_hook(lambda *_, n=nbytes: _transient(n)))
            handles.append(module.register_forward_hook(_in_backward(nbytes)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _transient(nbytes: int) -> None:
    # Made in the trace's mode (fake under FakeTensorMode), counted, dropped at once.
    torch.empty(nbytes, dtype=torch.uint8)


def _in_backward(nbytes: int) -> Any:
    """A forward hook: when the input needs a gradient, the output's gradient hook
    allocates the transient as backward reaches the module (the real linear's backward
    dequantizes only then; a hook on the module's backward would fire regardless)."""
    def after(module: nn.Module, args: Any, output: Any) -> None:
        first = args[0] if args else None
        if (isinstance(first, torch.Tensor) and first.requires_grad and isinstance(output, torch.Tensor)
                and output.requires_grad):
            output.register_hook(lambda grad: _transient(nbytes))

    return after


def from_pretrained_call(strategy: Any, quantize: str, precision: str, checkpoint: bool | None,
                         *, plan: bool = False) -> str:
    """The ``annot.from_pretrained`` call that trains a quantized base on ``strategy``
    (a DDP or FSDP2 row), as code: the dtype is chosen when loading (a quantized model refuses
    ``model.to(dtype)``). ``plan``: the call passes the answer's Plan (``policy=plan``, a
    budget's per-block choices) on to ``auto_wrap``."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    options = ["policy=plan"] if plan else []
    options += [f"{key}={value!r}" for key, value in strategy.engine_options(precision).items()]
    if checkpoint is not None:
        options.append(f"checkpoint={checkpoint}")
    return (f'annot.from_pretrained(DIR, "{strategy.engine}", peft_config=..., quantize="{quantize}", '
            f"torch_dtype=torch.{dtype}{''.join(', ' + o for o in options)})")
