"""Old spellings of the public API that keep working for one minor release.

Every deprecation warns with a `DeprecationWarning` that names the replacement and the
release that removes the old spelling, and gives the same result as the new spelling.
CHANGELOG.md lists each one under "Deprecated"; removing one is a changelog entry too.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["REMOVED_IN", "moved_attribute", "warn_deprecated"]

#: The release that removes the spellings deprecated in this one.
REMOVED_IN = "0.3.0"

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_deprecated(old: str, new: str, removed_in: str = REMOVED_IN) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` and goes in ``removed_in``
    (one release after the one that deprecates it), at the line of the first caller
    outside annot: the user's line however deep inside annot the old spelling was
    noticed (``from_pretrained`` passing ``auto_wrap``'s options on), and where Python's
    default filters show a `DeprecationWarning`."""
    warnings.warn(f"{old} is deprecated and will be removed in annot {removed_in}: use {new}",
                  DeprecationWarning, stacklevel=_first_level_outside_annot())


def _first_level_outside_annot() -> int:
    """The ``stacklevel`` (as `warnings.warn` in `warn_deprecated` counts it) of the
    first frame whose code is not annot's."""
    frame = sys._getframe(2)  # warn_deprecated's caller: level 2
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def moved_attribute(old_module: str, new_module: ModuleType, name: str) -> Any:
    """``name`` of ``new_module``, reached through ``old_module`` (the path it had in
    the previous release), with a warning naming the new path. For a module-level
    ``__getattr__`` of a shim module: an unknown name is the usual `AttributeError`, so
    ``hasattr`` behaves as for any module."""
    if name.startswith("__") or not hasattr(new_module, name):
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    warn_deprecated(f"{old_module}.{name}", f"{new_module.__name__}.{name}")
    return getattr(new_module, name)
