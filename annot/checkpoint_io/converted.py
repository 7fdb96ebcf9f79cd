"""Model tensors built from several checkpoint tensors, described as slices of them
and read block by block.

A format adapter (`annot.formats`) says which model tensors a checkpoint builds from
several of its keys: transformers 5, for one, saves one key per expert and fuses them
into 3-D ``experts.gate_up_proj`` on load. Each such tensor is a small tree of `Node`
objects (a checkpoint tensor, stacks, concatenations, narrows, transposes), and `read`
gives any block of it by reading only the blocks of the source tensors it covers: an
FSDP2 shard of experts ``[a, b)`` reads those experts' tensors, and of a concatenated
gate/up only the rows it needs from each (docs/design.md, pitfall 42). Nothing here
knows a format or reads a file: the caller passes a `Reader` for blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["Cat", "Conversions", "Narrow", "Node", "Reader", "Source", "Stack", "Transpose",
           "put", "read", "read_flat", "read_into"]

Shape = tuple[int, ...]
#: ``reader(key, start, shape)``: indices ``start[d]:start[d] + shape[d]`` of the
#: checkpoint tensor ``key``, in its own dtype.
Reader = Callable[[str, Shape, Shape], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Node:
    """A tensor as transformers' conversion builds it, described by where its values
    come from. ``shape`` and ``dtype`` are the converted tensor's."""

    shape: Shape
    dtype: torch.dtype

    def sources(self) -> list[str]:
        """The checkpoint keys this tensor is built from, in order."""
        return [key for part in self.parts() for key in part.sources()]

    def parts(self) -> Sequence[Node]:
        return ()


@dataclasses.dataclass(frozen=True)
class Source(Node):
    """A checkpoint tensor as it is in the file."""

    key: str = ""

    def sources(self) -> list[str]:
        return [self.key]


@dataclasses.dataclass(frozen=True)
class Stack(Node):
    """``torch.stack(inputs, dim)``: one new dimension, one index per input."""

    inputs: tuple[Node, ...] = ()
    dim: int = 0

    def parts(self) -> Sequence[Node]:
        return self.inputs


@dataclasses.dataclass(frozen=True)
class Cat(Node):
    """``torch.cat(inputs, dim)``: the inputs one after another along ``dim``."""

    inputs: tuple[Node, ...] = ()
    dim: int = 0

    def parts(self) -> Sequence[Node]:
        return self.inputs


@dataclasses.dataclass(frozen=True)
class Narrow(Node):
    """``input.narrow(dim, start, shape[dim])``: one piece of a chunk or split."""

    input: Node | None = None
    dim: int = 0
    start: int = 0

    def parts(self) -> Sequence[Node]:
        return (self.input,) if self.input is not None else ()


@dataclasses.dataclass(frozen=True)
class Transpose(Node):
    """``input.transpose(dim0, dim1)``."""

    input: Node | None = None
    dim0: int = 0
    dim1: int = 1

    def parts(self) -> Sequence[Node]:
        return (self.input,) if self.input is not None else ()


def read(node: Node, start: Sequence[int], shape: Sequence[int], reader: Reader) -> torch.Tensor:
    """Indices ``start[d]:start[d] + shape[d]`` of the converted tensor ``node``,
    reading through ``reader`` only the source blocks they come from."""
    out = torch.empty(tuple(shape), dtype=node.dtype)
    read_into(node, start, shape, reader, out)
    return out


def read_into(node: Node, start: Sequence[int], shape: Sequence[int], reader: Reader,
              out: torch.Tensor) -> None:
    """`read` into ``out`` (a tensor of ``shape``, any strides; values cast to its dtype),
    such as the parameter's own local block: no more than one source block is alive at
    a time, where building the block by stacking and concatenating held it twice over."""
    start, shape = tuple(start), tuple(shape)
    if len(start) != len(node.shape) or len(shape) != len(node.shape) or any(
            s < 0 or n < 0 or s + n > full for s, n, full in zip(start, shape, node.shape, strict=True)):
        raise ValueError(f"block at {start} of shape {shape} is not inside {node.shape}")
    if tuple(out.shape) != shape:
        raise ValueError(f"the destination is {tuple(out.shape)}, the block {shape}")
    if not math.prod(shape):
        return
    if isinstance(node, Source):
        out.copy_(reader(node.key, start, shape))
    elif isinstance(node, Stack):
        d = node.dim
        inner_start, inner_shape = start[:d] + start[d + 1:], shape[:d] + shape[d + 1:]
        for j in range(shape[d]):
            read_into(node.inputs[start[d] + j], inner_start, inner_shape, reader, out.select(d, j))
    elif isinstance(node, Cat):
        d, offset = node.dim, 0
        for part in node.inputs:
            low, high = max(start[d], offset), min(start[d] + shape[d], offset + part.shape[d])
            if low < high:  # only the inputs the block overlaps are read
                read_into(part, put(start, d, low - offset), put(shape, d, high - low), reader,
                          out.narrow(d, low - start[d], high - low))
            offset += part.shape[d]
    elif isinstance(node, Narrow) and node.input is not None:
        read_into(node.input, put(start, node.dim, start[node.dim] + node.start), shape, reader, out)
    elif isinstance(node, Transpose) and node.input is not None:
        a, b = node.dim0, node.dim1
        swapped_start = put(put(start, a, start[b]), b, start[a])
        swapped_shape = put(put(shape, a, shape[b]), b, shape[a])
        read_into(node.input, swapped_start, swapped_shape, reader, out.transpose(a, b))
    else:
        raise TypeError(f"unknown conversion node {node!r}")


def read_flat(node: Node, start: int, stop: int, reader: Reader) -> torch.Tensor:
    """Elements ``start:stop`` of the converted tensor flattened (a flat shard: FSDP1,
    DeepSpeed ZeRO-3), read as the rows that cover them. The rows' other elements are
    read and dropped: at most two partial rows per range."""
    if not node.shape:
        return read(node, (), (), reader).reshape(-1)[start:stop]
    per_row = math.prod(node.shape[1:])
    first, last = start // per_row, -(-stop // per_row)
    rows = read(node, (first,) + (0,) * (len(node.shape) - 1), (last - first, *node.shape[1:]), reader)
    return rows.reshape(-1)[start - first * per_row:stop - first * per_row]


def put(values: Shape, index: int, value: int) -> Shape:
    """``values`` with position ``index`` replaced by ``value``."""
    return values[:index] + (value,) + values[index + 1:]


@dataclasses.dataclass(frozen=True)
class Conversions:
    """What a checkpoint's converted keys give: the model tensors they build (model name
    -> `Node`) and the checkpoint keys used for them."""

    targets: Mapping[str, Node] = dataclasses.field(default_factory=dict)
    consumed: frozenset[str] = frozenset()
