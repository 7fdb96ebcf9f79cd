"""A frozen base quantized to 4 bits while it loads (QLoRA's NF4), for FSDP2.

`quantize_on_load` is what ``annot.from_pretrained(..., quantize="nf4")`` does between
building the model on the meta device and wrapping it: it chooses the linears to
quantize (`choose_linears`); then, unit by unit just before FSDP2 shards it, each
chosen weight is read whole from the checkpoint, quantized with torchao's ``to_nf4``
(64-element blocks, their scales quantized again in blocks of 256, less the whole
tensor's mean scale) and put in place of the meta weight. FSDP2 splits each quantized
weight into its ranks' rows (torchao's tensor cuts its packed bytes and scales) and
all-gathers the packed bytes at each use; the load reads everything else as usual and
leaves the quantized weights alone (`CheckpointSource.filled`).

Why whole tensors: the double quantization subtracts the mean of every block's scale
over the whole tensor, so quantizing a rank's rows alone gives other bytes than
quantizing the tensor and splitting it. A rank therefore holds, for a moment, one whole
weight in the model's dtype and one unit's quantized weights whole, besides the shards
of the units before it.

Which linears: every ``nn.Linear`` whose weight is frozen (a PEFT model's base layers,
after ``peft_config`` froze them) except the output head (the model's output
embeddings), a mixture-of-experts router (a linear named ``gate`` or ``router`` beside
an ``experts`` module), and a weight whose shape cannot be split into whole scale
blocks on the ranks it is sharded over (rows divisible by the ranks, and each rank's
elements by 64 x 256): those stay in the model's dtype, each with the reason, and
`QuantizedLinears.describe` says which. So do frozen stacked weights (transformers 5's
fused experts, 3-D): listed as kept, since only linears are quantized; and the linears
inside the modules a rule of the user's selects (``unquantized=``, `choose_linears`).
`quantized_plan` puts the counts in the Plan's table.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from annot._progress import Progress
from annot.checkpoint_io.formats import CheckpointSource
from annot.checkpoint_io.loading import WholeTensors, state_names
from annot.host_memory import release_freed_heap
from annot.policies import Rule, parse_rule
from annot.policies.experts import router_paths
from annot.policies.model_index import ModelIndex

__all__ = ["FORMATS", "QuantizedLinears", "choose_linears", "import_torchao", "nf4_tensor_type", "quantize_on_load",
           "quantized_plan", "refuse_dtype_casts", "refuse_format"]

#: Quantization formats ``quantize=`` takes.
FORMATS = ("nf4",)
#: torchao's NF4 blocks: 64 weights share a scale, 256 scales share a second-level scale.
BLOCK = 64
SCALER_BLOCK = 256

logger = logging.getLogger("annot")


@dataclasses.dataclass(frozen=True)
class QuantizedLinears:
    """Which frozen linears' weights are quantized (their state names) and which stay in
    the model's dtype, each with the reason."""

    quantized: tuple[str, ...]
    kept: dict[str, str]

    def describe(self) -> str:
        """One paragraph: how many are quantized, and each kept one with its reason."""
        lines = [f"quantized to NF4: {len(self.quantized)} linear weights"]
        if self.kept:
            lines.append("kept in the model's dtype: " + "; ".join(
                f"{name} ({reason})" for name, reason in self.kept.items()))
        return "\n".join(lines)


def refuse_format(quantize: str, engine: str | None) -> None:
    """Raise ``ValueError`` for a format annot does not quantize to, or an engine that
    does not train a quantized base yet, before anything is built."""
    if quantize not in FORMATS:
        raise ValueError(f"quantize={quantize!r}: annot quantizes to {', '.join(map(repr, FORMATS))} "
                         "(QLoRA's 4-bit NormalFloat, through torchao, whose FSDP2 all-gather moves "
                         "the packed bytes); 8-bit and FP8 weight-only bases are not built in this "
                         "release (float8 training of the whole model is issue #45's)")
    if engine not in (None, "fsdp2", "fully_shard", "ddp"):
        raise ValueError(
            f"quantize={quantize!r} trains under engine='fsdp2' or 'ddp' (or loads with engine=None) "
            f"in this release; {engine!r} is not built for a quantized base yet (FSDP1 needs the "
            "packed bytes in its flat parameter's dtype, DeepSpeed ZeRO-3 partitions a flat copy "
            "that would pass them through a float conversion): use engine='fsdp2'")


def import_torchao(module: str, *, extra: str, asked: str) -> Any:
    """torchao's ``module``; `ImportError` naming annot's ``extra`` to install when torchao
    is missing (``asked``: what needed it, for the message)."""
    import importlib

    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    # torchao says at import that its CUDA kernels did not load: noise on a CPU machine,
    # and nothing annot uses.
    torchao_logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{asked} needs torchao: pip install 'annot-train[{extra}]' "
                          f"(or pip install torchao) ({exc})") from None
    finally:
        torchao_logger.setLevel(level)


def nf4_tensor_type() -> tuple[type, Any]:
    """torchao's ``NF4Tensor`` class and ``to_nf4`` function; `ImportError` naming the
    extra to install when torchao is missing."""
    quantization = import_torchao("torchao.quantization", extra="qlora", asked="quantize='nf4'")
    return quantization.NF4Tensor, quantization.to_nf4


def choose_linears(model: nn.Module, shards: int = 1, unquantized: Rule | str | None = None) -> QuantizedLinears:
    """The linears of ``model`` (unwrapped, possibly on the meta device) whose weights
    `quantize_on_load` quantizes when each is split over ``shards`` ranks (see the module
    docstring for the rule); names are ``model``'s state names. ``unquantized``: a rule
    (`annot.by_name`, `annot.by_class`, ...) whose modules keep their linears in the
    model's dtype: a linear inside a selected module (a LoRA layer's ``base_layer``
    inside the selected ``o_proj``) or selected itself; text is parsed as ``annot plan``'s
    rules are (`annot.policies.parse_rule`)."""
    names = {id(tensor): name for name, tensor in state_names(model).items()}
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    routers = router_paths(model)
    if isinstance(unquantized, str):
        unquantized = parse_rule(unquantized)
    elif unquantized is not None and not isinstance(unquantized, Rule):
        raise TypeError(f"unquantized= takes a rule (annot.by_name(...), ...) or its text, not "
                        f"{type(unquantized).__name__}")
    chosen_by_rule = unquantized.select(ModelIndex(model)) if unquantized is not None else {}
    quantized: list[str] = []
    kept: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        name = names.get(id(module.weight), f"{path}.weight")
        ruled = next((prefix for prefix in _prefixes(f"{path}.weight") if prefix in chosen_by_rule), None)
        reason = (f"unquantized={unquantized} selects {ruled or '(the model)'}" if ruled is not None
                  else _kept_because(module, path, head, routers, shards))
        if reason is None:
            quantized.append(name)
        else:
            kept[name] = reason
    for name, tensor in state_names(model).items():  # fused experts: (experts, rows, columns)
        if tensor.dim() >= 3 and isinstance(tensor, nn.Parameter) and not tensor.requires_grad:
            kept[name] = f"a stacked {tensor.dim()}-D weight (fused experts): only linears are quantized"
    return QuantizedLinears(tuple(quantized), kept)


def quantized_plan(plan: Any, model: nn.Module, linears: QuantizedLinears) -> Any:
    """``plan`` (an `annot.Plan` of ``model``) with each unit's and the root's count of
    quantized parameters (``linears.quantized``): the Plan table's ``quantized`` column.
    A weight belongs to the unit whose module path is the longest prefix of its name."""
    sizes = {name: tensor.numel() for name, tensor in state_names(model).items()}
    paths = {path: index for index, unit in enumerate(plan.units) for path in unit.modules}
    counts = [0] * len(plan.units)
    root = 0
    for name in linears.quantized:
        owner = next((paths[prefix] for prefix in _prefixes(name) if prefix in paths), None)
        if owner is None:
            root += sizes[name]
        else:
            counts[owner] += sizes[name]
    units = tuple(dataclasses.replace(unit, quantized=count) for unit, count in zip(plan.units, counts,
                                                                                  strict=True))
    return dataclasses.replace(plan, units=units, root=dataclasses.replace(plan.root, quantized=root))


def _prefixes(name: str) -> list[str]:
    """``"a.b.c.weight"`` -> ``["a.b.c", "a.b", "a", ""]``: its modules, deepest first."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _kept_because(module: nn.Linear, path: str, head: nn.Module | None, routers: set[str],
                  shards: int) -> str | None:
    if head is not None and (module is head or module.weight is getattr(head, "weight", None)):
        return "the output head"
    if path in routers:
        return "a mixture-of-experts router"
    if not module.weight.dtype.is_floating_point:
        return f"stored as {module.weight.dtype}"
    rows, columns = module.weight.shape
    per_rank = rows * columns // shards if rows % shards == 0 else 0
    if per_rank == 0 or per_rank % (BLOCK * SCALER_BLOCK):
        return (f"{rows} x {columns} does not split into whole blocks of {BLOCK * SCALER_BLOCK} "
                f"weights on {shards} rank{'s' if shards > 1 else ''}")
    return None


def quantize_on_load(model: nn.Module, source: CheckpointSource, linears: QuantizedLinears,
                     device: torch.device | None = None) -> CheckpointSource:
    """``source`` with ``linears.quantized`` (weights of the unwrapped ``model``, still on
    the meta device) marked filled, and the function that fills them: each replaced by
    torchao's NF4 quantization of its tensor read whole from ``source``, frozen. An
    engine calls it on each unit just before sharding it, so a rank holds one unit's
    quantized weights whole at a time; the load fills what is left
    (`CheckpointSource.fill_before_load`). Each weight is quantized on ``device``
    (default the CPU), where it then stays. The checkpoint's headers are checked here,
    before anything is read. Logs what was quantized, what was not, and the time."""
    quantizer = _Quantizer(model, source, linears, device or torch.device("cpu"))
    return dataclasses.replace(source, filled=source.filled | frozenset(linears.quantized),
                               fill_before_sharding=quantizer)


class _Quantizer:
    """Quantizes, on each call, the chosen weights owned by the modules given (or by
    their submodules) that are not quantized yet."""

    def __init__(self, model: nn.Module, source: CheckpointSource, linears: QuantizedLinears,
                 device: torch.device) -> None:
        _, self._to_nf4 = nf4_tensor_type()
        self._device = device
        self._reader = WholeTensors(model, source.path, linears.quantized, format=source.format)
        self._owners = {name: _owner(model, name) for name in linears.quantized}
        self._linears = linears
        self._progress = Progress("quantizing", len(linears.quantized))
        self._seconds = 0.0
        self._read = 0

    def __call__(self, modules: Sequence[nn.Module]) -> None:
        inside = {id(module) for root in modules for module in root.modules()}
        names = [name for name, (owner, _) in self._owners.items() if id(owner) in inside]
        if not names:
            return
        if len(self._owners) == len(self._linears.quantized):
            self._progress.__enter__()
        started = time.perf_counter()
        for name in names:
            module, attribute = self._owners.pop(name)
            tensor = self._reader.read(name).to(self._device)
            self._read += tensor.nbytes
            with torch.no_grad():
                quantized = self._to_nf4(tensor.contiguous(), BLOCK, SCALER_BLOCK)
            del tensor
            setattr(module, attribute, nn.Parameter(quantized, requires_grad=False))
            if self._device.type == "cpu":  # the quantization's temporaries, back to the kernel
                release_freed_heap()
            self._progress.advance()
        self._seconds += time.perf_counter() - started
        if not self._owners:
            self._progress.__exit__(None, None, None)
            logger.info("%s (read %.2f GiB, %.1f s)", self._linears.describe(), self._read / 2**30,
                        self._seconds)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return model.get_submodule(path), attribute


#: nn.Module's dtype casts: each would dequantize every NF4 weight into a dense copy.
_CASTS = ("half", "float", "double", "bfloat16")


def refuse_dtype_casts(model: nn.Module) -> None:
    """Make ``model.to(dtype)`` (and ``half()``, ``float()``, ``double()``,
    ``bfloat16()``) on a model with quantized weights raise, naming the fix. torchao's
    ``NF4Tensor`` answers a cast with its dequantized weight, so ``nn.Module`` would
    swap every 4-bit weight for a dense one (four to eight times its memory; under FSDP2
    a parameter its engine no longer knows) and train on: no error, the reason for
    quantizing gone. ``to(device)`` stays as it was. Set on ``model`` itself (the
    module the user holds), as transformers refuses ``to`` on its bitsandbytes models;
    a submodule's own ``to`` is not guarded."""
    module_to = model.to

    def to(*args: Any, **kwargs: Any) -> Any:
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            _refuse_cast(f"to({dtype})")
        return module_to(*args, **kwargs)

    object.__setattr__(model, "to", to)
    for cast in _CASTS:
        object.__setattr__(model, cast, lambda *_, name=cast: _refuse_cast(f"{name}()"))


def _refuse_cast(call: str) -> None:
    raise TypeError(
        f"model.{call} on a model with NF4-quantized weights would replace each with a dense "
        "dequantized copy: choose the dtype when loading (annot.from_pretrained(..., "
        "torch_dtype=...), which the quantized weights dequantize to), or compute in another "
        "dtype with mixed_precision=...")
