"""Tensors a module keeps as plain attributes: neither parameters nor buffers.

Some constructors compute a table and keep it as an ordinary attribute (diffusers'
QwenImage rotary embedding's ``pos_freqs``; Lumina2's ``freqs_cis``, a list of them).
Nothing in ``nn.Module`` knows these tensors: ``to_empty``, ``state_dict`` and the
engines pass them by. A model built on the meta device keeps them on the meta device,
so its forward fails ("Cannot copy out of meta tensor"), and a trace of it on fake
tensors mixes them with the fake ones. annot's record of construction
(`annot.meta.deferred`) keeps how each was computed and `annot.materialize` gives it
its values; the memory planner's fake copy makes them fake.

An attribute is named ``path.attr`` (``path.attr.i`` for the i-th tensor of a list or
tuple attribute), ``path`` being the module's in ``named_modules``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["map_tensor_attributes", "tensor_attributes"]


def _own(module: nn.Module) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """(attribute, index in its list or ``None``, tensor) of ``module``'s own plain
    tensor attributes."""
    for name, value in vars(module).items():
        if name.startswith("_annot"):
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            yield name, None, value
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):
                    yield name, index, item


def _joined(path: str, name: str, index: int | None) -> str:
    dotted = f"{path}.{name}" if path else name
    return dotted if index is None else f"{dotted}.{index}"


def tensor_attributes(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every plain tensor attribute under ``root`` by its name (module docstring), each
    module once."""
    return {_joined(path, name, index): tensor
            for path, module in root.named_modules()
            for name, index, tensor in _own(module)}


def map_tensor_attributes(root: nn.Module, function: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Replace every plain tensor attribute under ``root`` by ``function(name, tensor)``,
    in place (a list attribute stays a list, a tuple becomes a new tuple)."""
    for path, module in root.named_modules():
        found = list(_own(module))
        for name, index, tensor in found:
            new = function(_joined(path, name, index), tensor)
            if index is None:
                module.__dict__[name] = new
            else:
                holder = module.__dict__[name]
                if isinstance(holder, list):
                    holder[index] = new
                else:
                    module.__dict__[name] = (*holder[:index], new, *holder[index + 1:])
