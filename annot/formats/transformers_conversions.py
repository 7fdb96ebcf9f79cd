"""transformers' weight converters (fused mixture-of-experts weights, concatenated or
split projections) planned as slices of the checkpoint's tensors.

transformers 5 saves one key per expert (``...experts.0.gate_proj.weight``) and builds
the model's 3-D ``experts.gate_up_proj`` from them at load time through the
`WeightConverter` rules of its conversion mapping. `plan_conversions` runs those
converters' own operations once, on symbolic stand-ins of the checkpoint tensors
(`_Symbol`): what the operations do (stack, concatenate, chunk, split, transpose) is
recorded as a tree of `annot.checkpoint_io.converted` nodes per model tensor, and no
data is touched; the generic loader then reads any block of it from the source blocks
it covers. An operation that does anything else (reshapes, permutations, arithmetic)
cannot be stated as slices: planning refuses it with a `CheckpointError` naming the
tensor and the operation, never a silent difference (docs/design.md, pitfall 42).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from annot.checkpoint_io.converted import (
    Cat,
    Conversions,
    Narrow,
    Node,
    Source,
    Stack,
    Transpose,
    put,
)
from annot.errors import CheckpointError

if TYPE_CHECKING:
    from annot.formats.transformers_keys import KeyRules

__all__ = ["plan_conversions"]

Shape = tuple[int, ...]


class _Untraceable(Exception):
    """An operation the conversion called that is not a slice, stack or concatenation."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _Symbol(torch.Tensor):
    """A meta tensor that records, as a `Node`, which checkpoint tensors it is made of.
    transformers' conversion operations run on these as on real tensors; every torch
    call that returns a tensor and is not one of `_TRACED` raises `_Untraceable`."""

    node: Node
    _TRACED: ClassVar[dict[Any, Callable[..., Any]]] = {}

    @staticmethod
    def of(node: Node) -> _Symbol:
        symbol = torch.Tensor._make_subclass(_Symbol, torch.empty(node.shape, dtype=node.dtype, device="meta"))
        symbol.node = node
        return symbol

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in cls._TRACED:
            return cls._TRACED[func](*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        flat, _ = torch.utils._pytree.tree_flatten(result)
        if any(isinstance(value, torch.Tensor) for value in flat):
            raise _Untraceable(getattr(func, "__name__", repr(func)))
        return result  # metadata: shape, size, dim, dtype...


def _meta(symbols: Iterable[_Symbol]) -> list[torch.Tensor]:
    return [torch.empty(s.node.shape, dtype=s.node.dtype, device="meta") for s in symbols]


def _symbols(values: Any, what: str) -> list[_Symbol]:
    values = list(values)
    if not values or not all(isinstance(value, _Symbol) for value in values):
        raise _Untraceable(f"{what} of tensors not from the checkpoint")
    return values


def _dtype(symbols: Sequence[_Symbol]) -> torch.dtype:
    dtype = symbols[0].node.dtype
    for symbol in symbols[1:]:
        dtype = torch.promote_types(dtype, symbol.node.dtype)
    return dtype


# Shapes are computed here, not by torch on meta tensors: torch's meta stack and cat run
# its Python reference implementations, 20 ms a call (2.9 s for a 48-layer, 128-expert
# checkpoint, measured).
def _stack(tensors: Sequence[Any], dim: int = 0, **_: Any) -> _Symbol:
    symbols = _symbols(tensors, "stack")
    shape = symbols[0].node.shape
    if any(s.node.shape != shape for s in symbols):
        raise _Untraceable(f"stack of tensors of different shapes {sorted({s.node.shape for s in symbols})}")
    dim %= len(shape) + 1
    return _Symbol.of(Stack(shape[:dim] + (len(symbols),) + shape[dim:], _dtype(symbols),
                            tuple(s.node for s in symbols), dim))


def _cat(tensors: Sequence[Any], dim: int = 0, **_: Any) -> _Symbol:
    symbols = _symbols(tensors, "cat")
    shape = symbols[0].node.shape
    dim %= max(len(shape), 1)
    if any(len(s.node.shape) != len(shape) or put(s.node.shape, dim, 0) != put(shape, dim, 0)
           for s in symbols):
        raise _Untraceable(f"cat of tensors of shapes {[s.node.shape for s in symbols]}")
    size = sum(s.node.shape[dim] for s in symbols)
    return _Symbol.of(Cat(put(shape, dim, size), _dtype(symbols), tuple(s.node for s in symbols), dim))


def _pieces(symbol: _Symbol, meta_pieces: Sequence[torch.Tensor], dim: int) -> tuple[_Symbol, ...]:
    dim %= len(symbol.node.shape)
    out, offset = [], 0
    for piece in meta_pieces:
        out.append(_Symbol.of(Narrow(tuple(piece.shape), piece.dtype, symbol.node, dim, offset)))
        offset += piece.shape[dim]
    return tuple(out)


def _chunk(tensor: _Symbol, chunks: int, dim: int = 0) -> tuple[_Symbol, ...]:
    (symbol,) = _symbols([tensor], "chunk")
    return _pieces(symbol, torch.chunk(_meta([symbol])[0], chunks, dim), dim)


def _split(tensor: _Symbol, split_size_or_sections: Any, dim: int = 0) -> tuple[_Symbol, ...]:
    (symbol,) = _symbols([tensor], "split")
    return _pieces(symbol, torch.split(_meta([symbol])[0], split_size_or_sections, dim), dim)


def _transpose(tensor: _Symbol, dim0: int, dim1: int) -> _Symbol:
    (symbol,) = _symbols([tensor], "transpose")
    ndim = len(symbol.node.shape)
    a, b = dim0 % ndim, dim1 % ndim
    if a == b:
        return symbol
    shape = put(put(symbol.node.shape, a, symbol.node.shape[b]), b, symbol.node.shape[a])
    return _Symbol.of(Transpose(shape, symbol.node.dtype, symbol.node, a, b))


def _same(tensor: _Symbol, *_: Any, **__: Any) -> _Symbol:
    """``contiguous()``: the values are the same (a read copies anyway)."""
    return tensor


_Symbol._TRACED.update({
    torch.stack: _stack, torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat,
    torch.chunk: _chunk, torch.Tensor.chunk: _chunk,
    torch.split: _split, torch.Tensor.split: _split,
    torch.transpose: _transpose, torch.Tensor.transpose: _transpose, torch.swapaxes: _transpose,
    torch.Tensor.contiguous: _same,
})


def plan_conversions(model: nn.Module, rules: KeyRules, sources: Mapping[str, tuple[Shape, torch.dtype]]
                     ) -> Conversions:
    """The model tensors that transformers' converters build from the checkpoint keys
    ``sources`` (key -> shape and dtype), each as a `Node`, by running the converters'
    operations of ``rules`` (`annot.formats.transformers_keys.key_rules`) on symbols. Keys whose
    converted name is not in the model are left out (they are unexpected keys, as for
    transformers). Raises `CheckpointError` naming the tensor and the operation where
    an operation is not a slice, stack, concatenation or transpose."""
    from transformers.core_model_loading import dot_natural_key

    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(sources, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        name, converter, pattern = rules.resolve(key)
        if converter is None or pattern is None or name not in rules.names:
            continue
        groups.setdefault(name, (converter, defaultdict(list)))[1][pattern].append(key)
    targets: dict[str, Node] = {}
    consumed: set[str] = set()
    for name, (converter, by_pattern) in groups.items():
        keys = [key for group_keys in by_pattern.values() for key in group_keys]
        for target, node in _convert(model, name, converter, by_pattern, sources).items():
            if target not in rules.names:
                raise CheckpointError(f"{keys[0]}: transformers converts it into {target}, which "
                                      "the model does not have")
            targets[target] = node
        consumed.update(keys)
    return Conversions(targets, frozenset(consumed))


def _convert(model: nn.Module, name: str, converter: Any, by_pattern: Mapping[str, list[str]],
             sources: Mapping[str, tuple[Shape, torch.dtype]]) -> dict[str, Node]:
    """One converter's operations, in order, on symbols of its source keys (as
    transformers' `WeightConverter.convert` runs them), then its target patterns
    expanded to the model's full names."""
    collected: dict[str, Any] = {
        pattern: [_Symbol.of(Source(tuple(sources[k][0]), sources[k][1], k)) for k in keys]
        for pattern, keys in by_pattern.items()}
    first_key = next(iter(by_pattern.values()))[0]
    for operation in converter.operations:
        try:
            collected = operation.convert(
                collected, source_patterns=converter.source_patterns,
                target_patterns=converter.target_patterns, full_layer_name=name, model=model,
                config=getattr(model, "config", None), missing_keys=None)
        except _Untraceable as exc:
            raise CheckpointError(
                f"{name}: transformers builds it from {first_key} and others with "
                f"{type(operation).__name__}, which calls {exc.what}: annot reads converted tensors "
                "as slices, stacks, concatenations and transposes only. Load the model with "
                "transformers and annot.save it once: annot.save writes the model's own names") from None
        except Exception as exc:  # transformers' own refusal ("Undefined Operation", shapes)
            raise CheckpointError(f"{name}: transformers' {type(operation).__name__} cannot convert "
                                  f"{first_key} and the keys beside it: {exc}") from None
    full_name = name.replace("*.", "0.") if "*." in name else name
    # As transformers names the results: its target patterns between the prefix and
    # suffix the first target's full name has around its own pattern.
    prefix, suffix = "", ""
    for pattern in collected:
        if pattern in full_name:
            prefix, _, suffix = full_name.partition(pattern)
            break
    out: dict[str, Node] = {}
    for pattern, value in collected.items():
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        if not isinstance(value, _Symbol):
            raise CheckpointError(f"{name}: transformers' conversion of {first_key} gives "
                                  f"{type(value).__name__}, not one tensor")
        out[prefix + pattern + suffix] = value.node
    return out
