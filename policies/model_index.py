"""A read-only view of a model that rules and the planner share.

Walking ``named_modules`` and counting parameters once keeps planning a 70B-shaped
model on the meta device fast; nothing here allocates or touches tensor data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["ModelIndex", "qualified_class_name", "parent_path", "is_under"]


def qualified_class_name(module: nn.Module) -> str:
    klass = type(module)
    return f"{klass.__module__}.{klass.__qualname__}"


def parent_path(path: str) -> str:
    return path.rpartition(".")[0]


def is_under(path: str, ancestor: str) -> bool:
    """True when module ``path`` is ``ancestor`` itself or inside it ("" is the root)."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


class ModelIndex:
    """Modules of ``model`` in pre-order, with their positions and direct parameter counts."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.position: dict[str, int] = {path: i for i, path in enumerate(self.modules)}
        # Direct (non-recursive) parameters, each Parameter counted once where first seen,
        # so tied weights are not double counted.
        seen: set[int] = set()
        self.direct_params: dict[str, int] = {}
        for path, module in self.modules.items():
            count = 0
            for param in module.parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    count += param.numel()
            self.direct_params[path] = count
        # What rules derive from the whole model and several rules ask for (the
        # ``_no_split_modules`` names: five walks of every module per plan before).
        self.memo: dict[str, Any] = {}

    def __iter__(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(self.modules.items())

    def ordered(self, paths: dict[str, str]) -> dict[str, str]:
        """``paths`` re-ordered by module order (pre-order of ``named_modules``)."""
        return dict(sorted(paths.items(), key=lambda item: self.position[item[0]]))

    def children_paths(self, path: str) -> list[str]:
        module = self.modules[path]
        prefix = f"{path}." if path else ""
        return [prefix + name for name, _ in module.named_children()]
