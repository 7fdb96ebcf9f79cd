"""A frozen base quantized to 4 bits while it loads (QLoRA's NF4), for FSDP2.

`quantize_on_load` is what ``annot.from_pretrained(..., quantize="nf4")`` does between
building the model on the meta device and wrapping it: it chooses the linears to
quantize (`choose_linears`), reads each chosen weight whole from the checkpoint,
quantizes it with torchao's ``to_nf4`` (64-element blocks, their scales quantized again
in blocks of 256, less the whole tensor's mean scale) and puts the result in place of
the meta weight, one tensor at a time. FSDP2 then splits each quantized weight into its
ranks' rows (torchao's tensor cuts its packed bytes and scales) and all-gathers the
packed bytes at each use; the load reads everything else as usual and leaves the
quantized weights alone (`CheckpointSource.filled`).

Why whole tensors: the double quantization subtracts the mean of every block's scale
over the whole tensor, so quantizing a rank's rows alone gives other bytes than
quantizing the tensor and splitting it. A rank therefore holds, for a moment, one whole
weight in the model's dtype and its quantized copy, besides everything quantized so far
(each whole until FSDP2 splits it).

Which linears: every ``nn.Linear`` whose weight is frozen (a PEFT model's base layers,
after ``peft_config`` froze them) except the output head (the model's output
embeddings), a mixture-of-experts router (a linear named ``gate`` or ``router`` beside
an ``experts`` module), and a weight whose shape cannot be split into whole scale
blocks on the ranks it is sharded over (rows divisible by the ranks, and each rank's
elements by 64 x 256): those stay in the model's dtype, each with the reason, and
`QuantizedLinears.describe` says which.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from annot._progress import Progress
from annot.checkpoint_io.formats import CheckpointSource
from annot.checkpoint_io.loading import state_names, whole_tensors

__all__ = ["FORMATS", "QuantizedLinears", "choose_linears", "nf4_tensor_type", "quantize_on_load",
           "refuse_format"]

#: Quantization formats ``quantize=`` takes.
FORMATS = ("nf4",)
#: torchao's NF4 blocks: 64 weights share a scale, 256 scales share a second-level scale.
BLOCK = 64
SCALER_BLOCK = 256
_ROUTER_NAMES = ("gate", "router")

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
                         "(QLoRA's 4-bit NormalFloat, through torchao)")
    if engine not in (None, "fsdp2", "fully_shard"):
        raise ValueError(
            f"quantize={quantize!r} trains under engine='fsdp2' (or loads with engine=None) in this "
            f"release; {engine!r} is not built for a quantized base yet (FSDP1 needs the packed "
            "bytes in its flat parameter's dtype, DeepSpeed ZeRO-3 partitions a flat copy that "
            "would pass them through a float conversion): use engine='fsdp2'")


def nf4_tensor_type() -> tuple[type, Any]:
    """torchao's ``NF4Tensor`` class and ``to_nf4`` function; `ImportError` naming the
    extra to install when torchao is missing."""
    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    # torchao says at import that its CUDA kernels did not load: noise on a CPU machine,
    # and nothing annot uses.
    torchao_logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError as exc:
        raise ImportError("quantize='nf4' needs torchao: pip install 'annot-train[qlora]' "
                          f"(or pip install torchao) ({exc})") from None
    finally:
        torchao_logger.setLevel(level)
    return NF4Tensor, to_nf4


def choose_linears(model: nn.Module, shards: int = 1) -> QuantizedLinears:
    """The linears of ``model`` (unwrapped, possibly on the meta device) whose weights
    `quantize_on_load` quantizes when each is split over ``shards`` ranks (see the module
    docstring for the rule); names are ``model``'s state names."""
    names = {id(tensor): name for name, tensor in state_names(model).items()}
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    routers = _routers(model)
    quantized: list[str] = []
    kept: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.requires_grad:
            continue
        name = names.get(id(module.weight), f"{path}.weight")
        reason = _kept_because(module, path, head, routers, shards)
        if reason is None:
            quantized.append(name)
        else:
            kept[name] = reason
    return QuantizedLinears(tuple(quantized), kept)


def _routers(model: nn.Module) -> set[str]:
    return {f"{path}.{child}" if path else child
            for path, module in model.named_modules()
            if hasattr(module, "experts")
            for child in _ROUTER_NAMES if isinstance(getattr(module, child, None), nn.Linear)}


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


def quantize_on_load(model: nn.Module, source: CheckpointSource,
                     linears: QuantizedLinears) -> CheckpointSource:
    """Replace each of ``linears.quantized`` (weights of the unwrapped ``model``, still on
    the meta device) by torchao's NF4 quantization of its tensor read whole from
    ``source``, frozen; returns ``source`` with those names marked filled, for the load
    that follows. Logs what was quantized, what was not, and the time it took."""
    _, to_nf4 = nf4_tensor_type()
    started = time.perf_counter()
    owners = {name: _owner(model, name) for name in linears.quantized}
    read = 0
    with Progress("quantizing", len(linears.quantized)) as progress:
        for name, tensor in whole_tensors(model, source.path, linears.quantized, format=source.format):
            module, attribute = owners[name]
            read += tensor.nbytes
            with torch.no_grad():
                quantized = to_nf4(tensor.contiguous(), BLOCK, SCALER_BLOCK)
            setattr(module, attribute, nn.Parameter(quantized, requires_grad=False))
            del tensor
            progress.advance()
    logger.info("%s (read %.2f GiB, %.1f s)", linears.describe(), read / 2**30,
                time.perf_counter() - started)
    return dataclasses.replace(source, filled=source.filled | frozenset(linears.quantized))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return model.get_submodule(path), attribute
