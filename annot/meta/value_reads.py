"""Values a constructor reads while it is recorded: ``.item()`` on a tensor it made.

Under `annot.meta_init` a constructor runs on fake tensors, which hold no values, so a
constructor that reads one fails where plain PyTorch succeeds. CvT's stages do, and
transformers' code has the pattern elsewhere too::

    drop_path_rates = [x.item() for x in torch.linspace(0, rate, depth, device="cpu")]

The tape already says how that tensor was made. `value_of` replays, on real CPU tensors,
only the recorded operations its value depends on (every operation that made or wrote a
storage it reads, back to constants and factories; not those that only read one) and returns the value. It refuses
(returns ``None``, and the caller raises the original error) when that chain draws random
numbers (the replay would have to move the generator the recording did not) or holds a
tensor larger than `VALUE_READ_LIMIT` elements (a read of a weight's value, which a
deferred build cannot know without doing the work it defers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from annot.meta.tape import (
    Op,
    Ref,
    TensorLayout,
    draws_random_numbers,
    leaves,
    map_leaves,
    writes_of,
)

__all__ = ["VALUE_READ_LIMIT", "value_of"]

#: The most elements any tensor in a read value's chain may have: the read replays them.
VALUE_READ_LIMIT = 1 << 16


def value_of(index: int, ops: Sequence[Op], constants: Mapping[int, torch.Tensor],
             group_of: Mapping[int, int], layout: Mapping[int, TensorLayout]) -> torch.Tensor | None:
    """The real value of recorded tensor ``index``, or ``None`` when it cannot be known
    cheaply (see the module docstring). ``ops`` are the recorded operations (``func``,
    ``args``, ``kwargs``, ``out`` with tensors as references) in order; ``constants`` real
    tensors by index; ``group_of`` each index's storage group (aliases share one)."""
    needed_groups = {group_of[index]}
    chain: list[Any] = []
    for op in reversed(ops):
        # Needed: an operation that gives contents to a needed storage (what it returns,
        # or an argument it writes in place); one that only reads a needed tensor is not.
        written = [op.args[i] for i in writes_of(op.func)[0] if i < len(op.args)]
        if not any(isinstance(x, Ref) and group_of[x.index] in needed_groups for x in (*leaves(op.out), *written)):
            continue
        if draws_random_numbers(op.func):
            return None
        refs = [x for x in leaves((op.args, op.kwargs, op.out)) if isinstance(x, Ref)]
        if any(math.prod(layout[r.index].shape) > VALUE_READ_LIMIT for r in refs):
            return None
        needed_groups.update(group_of[r.index] for r in refs)
        chain.append(op)
    env: dict[int, torch.Tensor] = {i: t.clone() for i, t in constants.items()
                                    if group_of[i] in needed_groups}

    def real(x: Any) -> Any:
        return env[x.index] if isinstance(x, Ref) else x

    try:
        with torch.no_grad():
            for op in reversed(chain):
                result = op.func(*map_leaves(real, op.args), **map_leaves(real, op.kwargs))
                for ref, value in zip(leaves(op.out), leaves(result), strict=False):
                    if isinstance(ref, Ref) and isinstance(value, torch.Tensor):
                        env.setdefault(ref.index, value)
    except (KeyError, RuntimeError):  # a reference no chain operation made: unknowable here
        return None
    return env.get(index)
