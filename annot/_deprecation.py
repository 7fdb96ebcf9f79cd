"""Old spellings of the public API that keep working for one minor release.

Every deprecation warns with a `DeprecationWarning` that names the replacement and the
release that removes the old spelling, and gives the same result as the new spelling.
CHANGELOG.md lists each one under "Deprecated"; removing one is a changelog entry too.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

__all__ = ["REMOVED_IN", "moved_attribute", "warn_deprecated"]

#: The release that removes the spellings deprecated in this one.
REMOVED_IN = "0.3.0"


def warn_deprecated(old: str, new: str, *, stacklevel: int) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``.

    ``stacklevel`` counts from the caller of this function (1: that caller's line), so
    each call site passes the depth of the user's code below it: the warning then points
    at the user's line, where Python's default filters show a `DeprecationWarning`.
    """
    warnings.warn(f"{old} is deprecated and will be removed in annot {REMOVED_IN}: use {new}",
                  DeprecationWarning, stacklevel=stacklevel + 1)


def moved_attribute(old_module: str, new_module: ModuleType, name: str) -> Any:
    """``name`` of ``new_module``, reached through ``old_module`` (the path it had in
    the previous release), with a warning naming the new path. For a module-level
    ``__getattr__`` of a shim module: an unknown name is the usual `AttributeError`, so
    ``hasattr`` and ``from old import *`` behave as for any module."""
    if name.startswith("__") or not hasattr(new_module, name):
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    # 3: this function, the shim's __getattr__, then the user's import or attribute access
    warn_deprecated(f"{old_module}.{name}", f"{new_module.__name__}.{name}", stacklevel=3)
    return getattr(new_module, name)
