"""Values for a memory trace of a model that reads them: balanced routing.

The planner traces a step under ``FakeTensorMode``: shapes and dtypes, no values. A model
whose forward reads a value (``.item()``, ``.tolist()``, ``nonzero``, a split by counts)
cannot be traced so: torch raises ``DataDependentOutputException`` or
``DynamicOutputShapeException``. The models that do are almost all mixture-of-experts
layers that loop over their experts or split their tokens by expert (JetMoE,
LongCat-Flash), plus a few that check an input (XLM's ``lengths.max().item()``).

`ValueShadows` is a dispatch mode that keeps a real "shadow" tensor beside each fake one
whose value can be known without the model's weights:

- a tensor made from no tensor (``zeros``, ``arange``, ``full``: the trace's token ids,
  position ids, routing scratch) or from Python values (``torch.tensor([[1, 4, 4]])``: a
  vision-language model's image grid), and every result of operations whose inputs all have
  shadows (computed for real on the shadows, at most `SHADOW_LIMIT` elements each);
- the indices of a ``topk`` (``argmax``, ``max``/``min`` along a dimension) over values
  that have none, such as a router's scores, under the stated assumption
  `ROUTING_ASSUMPTION`: token ``t``'s ``j``-th choice among ``E`` is ``(t*k + j) mod E``,
  so every expert gets the same number of tokens; a sort of such values is the identity
  permutation.

A read of a shadowed value (``.item()``, ``nonzero``'s size) gets the shadow's; a read of
any other value still fails as before. A tensor whose shadow an in-place operation with
an unshadowed input would make stale loses it (with every alias of its storage).

The trace tries without shadows first (`annot.memory.activations`): only a model that
reads values is traced under the assumption, and its table says so.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from annot.memory.counting import storage_key

__all__ = ["INPUT_ASSUMPTION", "ROUTING_ASSUMPTION", "SHADOW_LIMIT", "ValueShadows", "reads_values"]

#: Printed with a table traced under `ValueShadows`.
ROUTING_ASSUMPTION = (
    "traced under balanced routing: this model reads routing values (a per-expert split "
    "or loop), which a trace without data cannot know, so each token's k choices among E "
    "experts were spread evenly (token t's j-th choice is expert (t*k + j) mod E, so each "
    "expert gets T*k/E of the T tokens; none dropped). Uneven routing moves bytes between the "
    "experts' transients; the states and the dense layers do not change")

#: Printed with a table whose trace read values of the inputs only.
INPUT_ASSUMPTION = (
    "traced on the inputs annot builds: this model reads values of its inputs (a length, a "
    "count of some token, an image grid, where its image tokens are), which the trace takes "
    "from them: full-length sequences of one ordinary token, each image's or audio clip's "
    "tokens where the model expects them, no padding")

#: The most elements a shadow holds (int64: 512 MiB, held while its fake tensor lives); a
#: larger result goes unshadowed. LongCat-Flash's expert mask at 2,048 tokens (top-12 of
#: 768 experts and identities) is 19M elements.
SHADOW_LIMIT = 1 << 26

_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException")

aten = torch.ops.aten
#: Index results that follow from routing scores: (operator, position of the indices
#: among the outputs, how they are laid out).
_ROUTING = {
    aten.topk.default: (1, "spread"),
    aten.max.dim: (1, "spread"),
    aten.min.dim: (1, "spread"),
    aten.argmax.default: (None, "spread"),
    aten.argmin.default: (None, "spread"),
    aten.sort.default: (1, "identity"),
    aten.sort.stable: (1, "identity"),
    aten.argsort.default: (None, "identity"),
    aten.argsort.stable: (None, "identity"),
}


#: Operators whose result holds whatever memory held.
#: Operators that turn a real tensor (a literal: ``torch.tensor([2, 4, 4])``) into a fake
#: one: its value is known, the literal's.
_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
#: Indexing operators -> where their list of indices is among the arguments.
_MASK_INDEXED = {aten.index.Tensor: 1, aten.index_put.default: 1, aten.index_put_.default: 1,
                 aten._index_put_impl_.default: 1}
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                  aten.new_empty.default, aten.new_empty_strided.default}


def reads_values(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's refusal to read a fake tensor's value: through an
    operation, or by C++ reading its memory outside any operation (UDOP turns a tensor
    into indices with ``zip(*ind)``: "its data is not allocated yet")."""
    return type(exc).__name__ in _DATA_DEPENDENT or (
        isinstance(exc, RuntimeError) and _UNALLOCATED_READ in str(exc))


_UNALLOCATED_READ = "but its data is not allocated yet"


class ValueShadows(TorchDispatchMode):
    """Answer value reads in a fake trace from real shadows (see the module's text).

    Enter it above the trace's ``FakeTensorMode`` (after it) and below any counting mode,
    so that tensors it makes are counted as the operation's outputs. `assumption` says
    what the answers rested on."""

    def __init__(self, limit: int = SHADOW_LIMIT) -> None:
        super().__init__()
        self.limit = limit
        self._shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # Storage -> the shadowed fakes on it (by id, weakly): an in-place write finds the
        # aliases it makes stale without scanning every shadow.
        self._by_storage: dict[int, dict[int, weakref.ref[torch.Tensor]]] = {}
        # The shadows that follow from the routing assumption (the rest: from the inputs).
        self._routed: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._reads = {"routing": False, "inputs": False}

    @property
    def assumption(self) -> str:
        """`ROUTING_ASSUMPTION` where a value read rested on it, else `INPUT_ASSUMPTION`
        where a value of the inputs was read, else "" (no value was read)."""
        if self._reads["routing"]:
            return ROUTING_ASSUMPTION
        return INPUT_ASSUMPTION if self._reads["inputs"] else ""

    def _read(self, tensors: list[torch.Tensor]) -> None:
        self._reads["routing" if any(t in self._routed for t in tensors) else "inputs"] = True

    def __enter__(self) -> ValueShadows:
        # ``torch.tensor([t0, t1])`` of 0-d tensors copies their data in C++, below any
        # dispatch mode (a fake tensor has none: "its data is not allocated"); Qwen-VL's
        # rope index builds one from per-sample maxima. Each is read through ``item()``
        # instead, which a shadow answers.
        self._tensor = torch.tensor
        original = self._tensor

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            return original(_items(data), *args, **kwargs)

        torch.tensor = tensor
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.tensor = self._tensor

    # -- shadows -----------------------------------------------------------------------
    def _attach(self, fake: Any, real: Any, routed: bool) -> None:
        fakes, _ = tree_flatten(fake)
        reals, _ = tree_flatten(real)
        for f, r in zip(fakes, reals, strict=False):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor) and f.shape == r.shape:
                self._keep(f, r)
                if routed:
                    self._routed[f] = True

    def _keep(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self._shadows[fake] = real
        self._by_storage.setdefault(storage_key(fake), {})[id(fake)] = weakref.ref(fake)

    def _forget(self, t: torch.Tensor) -> None:
        """Drop the shadows of ``t`` and of every alias of its storage."""
        for ref in self._by_storage.pop(storage_key(t), {}).values():
            fake = ref()
            if fake is not None:
                self._shadows.pop(fake, None)
                self._routed.pop(fake, None)

    def _small(self, out: Any) -> bool:
        leaves, _ = tree_flatten(out)
        return all(t.numel() <= self.limit for t in leaves if isinstance(t, torch.Tensor))

    def _real(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` run for real on the shadows of its tensor arguments."""
        swapped = tree_map(lambda t: self._shadows[t] if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with no_dispatch():
            real = func(*swapped[0], **swapped[1])
            if func in _UNINITIALIZED:  # no value to match: zeros, not stale memory
                tree_map(lambda r: r.zero_() if isinstance(r, torch.Tensor) else r, real)
        return real

    def _fake_of(self, real: Any) -> Any:
        """Fake tensors shaped as ``real``'s (made through the fake mode below this one)."""
        return tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=r.device)
                        if isinstance(r, torch.Tensor) else r, real)

    def _routing(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Shadow the index output of a top-k, argmax or sort over unshadowed values."""
        position, layout = _ROUTING[func]
        indices = out if position is None else out[position]
        source = args[0]
        dim = _argument(func, args, kwargs, "dim")
        if indices.dim() == 0:  # over all elements: one index
            with no_dispatch():
                self._keep(indices, torch.zeros((), dtype=indices.dtype))
            self._routed[indices] = True
            return
        if not isinstance(dim, int) or indices.numel() > self.limit:  # None here: over all, keepdim
            return
        dim = dim % indices.dim()
        choices = source.shape[dim] if source.dim() else 1
        moved = list(indices.shape)
        moved.append(moved.pop(dim))
        k = moved[-1]
        with no_dispatch():  # real tensors, not the fake mode's
            flat = torch.arange(indices.numel(), dtype=torch.long).reshape(-1, k)
            if layout == "spread":
                flat = flat % max(choices, 1)
            else:
                flat = torch.arange(k, dtype=torch.long).expand(flat.shape[0], k)
            self._keep(indices, flat.reshape(moved).movedim(-1, dim).to(indices.dtype).contiguous())
        self._routed[indices] = True

    def _masks_as_indices(self, func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` of an indexing ``func`` with each boolean mask whose value is known
        replaced by the integer indices of its true elements (known too): ``x[mask]`` of
        an unknown ``x`` has a size only the mask decides (Qwen3-VL puts its deepstack
        features where the image tokens are), which a fake trace cannot know."""
        position = _MASK_INDEXED[func]
        indices = args[position]
        if not isinstance(indices, (list, tuple)) or not any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool and i in self._shadows for i in indices):
            return args
        swapped: list[Any] = []
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index in self._shadows:
                with no_dispatch():
                    reals = self._shadows[index].nonzero(as_tuple=True)
                for real in reals:
                    fake = self._fake_of(real)
                    self._keep(fake, real)
                    swapped.append(fake)
                self._read([index])
            else:
                swapped.append(index)
        return (*args[:position], swapped, *args[position + 1:])

    # -- the mode ----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in _LIFTS and len(tensors) == 1 and not _is_fake(tensors[0]) and self._small(tensors[0]):
            # A literal made from Python values (an image grid, a length table): known.
            out = func(*args, **kwargs)
            with no_dispatch():
                self._keep(out, tensors[0].clone())
            return out
        if func in _MASK_INDEXED:
            args = self._masks_as_indices(func, args)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = all(t in self._shadows for t in tensors)
        if func is aten._local_scalar_dense.default and tensors and known:
            self._read(tensors)
            with no_dispatch():
                return self._shadows[tensors[0]].item()
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if not (reads_values(exc) and tensors and known):
                raise
            try:
                real = self._real(func, args, kwargs)
            except Exception:
                raise exc from None
            self._read(tensors)
            out = self._fake_of(real)
            self._attach(out, real, any(t in self._routed for t in tensors))
            return out
        mutated = _mutated(func, args, kwargs)
        if known and torch.Tag.nondeterministic_seeded not in func.tags and self._small(out):
            try:
                real = self._real(func, args, kwargs)
            except Exception:  # a value only the model's data makes valid (an index)
                for t in mutated:
                    self._forget(t)
                return out
            routed = any(t in self._routed for t in tensors)
            if not mutated:
                self._attach(out, real, routed)
            elif routed:
                for t in mutated:
                    self._routed[t] = True
        else:
            for t in mutated:
                self._forget(t)
            if func in _ROUTING and tensors and tensors[0] not in self._shadows:
                self._routing(func, args, kwargs, out)
        return out


def _items(data: Any) -> Any:
    """``data`` (``torch.tensor``'s) with every 0-d tensor in its lists read as a number."""
    if isinstance(data, torch.Tensor):
        return data.item() if data.dim() == 0 and _is_fake(data) else data
    if isinstance(data, (list, tuple)):
        return type(data)(_items(item) for item in data)
    return data


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes to (``self`` of an in-place operator, ``out=``)."""
    found = []
    for i, spec in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(spec.name)
        if isinstance(value, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write:
            found.append(value)
    return found


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The value of ``func``'s argument ``name`` in this call (its default when not given)."""
    for i, spec in enumerate(func._schema.arguments):
        if spec.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, spec.default_value if spec.has_default_value() else None)
    return None
