"""The construction record's vocabulary: a recorded operation (`Op`), the tensors on its
tape (`Ref`) and their layout (`TensorLayout`), and the walk over what aten operations
take and return (`map_leaves`, `leaves`), and what an operation's schema and tags say
it writes (`writes_of`) and whether it draws random numbers (`draws_random_numbers`). `annot.meta.deferred` records with them,
`annot.meta.value_reads` and `annot.meta.materialization` replay with them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Op", "Ref", "TensorLayout", "draws_random_numbers", "leaves", "map_leaves", "writes_of"]


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor on the tape, by its index."""

    index: int


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Shape, stride and dtype of a recorded tensor; ``whole`` when it covers its storage
    exactly (writing all of it replaces every byte of the storage)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    whole: bool


@dataclasses.dataclass
class Op:
    """One recorded operation: tensors in args/kwargs/out are `Ref`s. ``rng_state``: the
    CPU random state to set before it, when code inside `meta_init` changed the state
    (``torch.manual_seed``) since the previous operation; else ``None``. ``named_device``:
    the device the constructor asked for (``device="cuda"``, a ``with torch.device(...)``
    block) when it was not the one the record builds and replays on; else ``None``."""

    func: Any
    args: Any
    kwargs: Any
    out: Any
    rng_state: torch.Tensor | None = None
    named_device: torch.device | None = None


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``tree_map`` for what aten operations take and return (plain tuples, lists and
    dicts of leaves) without pytree's per-node bookkeeping, which was most of the
    recording's own time (profiled); any other container goes to pytree."""
    kind = type(x)
    if kind is tuple or kind is list:
        return kind(map_leaves(fn, v) for v in x)
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list, dict)):  # a named tuple, a subclass: pytree knows them
        return tree_map(fn, x)
    return fn(x)


def leaves(x: Any) -> Iterator[Any]:
    """The leaves of what `map_leaves` maps, in the same order as ``tree_flatten``."""
    kind = type(x)
    if kind is tuple or kind is list:
        for v in x:
            yield from leaves(v)
    elif kind is dict:
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (tuple, list, dict)):
        yield from tree_flatten(x)[0]
    else:
        yield x


@functools.cache
def writes_of(func: Any) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """From an aten operation's schema: the positions of the arguments it writes, and for
    each return whether it is fresh contents (not an alias of an argument)."""
    schema = func._schema
    written = tuple(i for i, argument in enumerate(schema.arguments)
                    if argument.alias_info is not None and argument.alias_info.is_write)
    return written, tuple(returned.alias_info is None for returned in schema.returns)


@functools.cache
def draws_random_numbers(func: Any) -> bool:
    """Whether an aten operation draws from a random-number generator: torch tags every
    one that does (uniform_, normal_, bernoulli, randperm, dropout, ...) so."""
    return torch.Tag.nondeterministic_seeded in func.tags
