"""Deprecated import path: ``annot.activation_checkpoint`` moved to `annot.runtime.activation_checkpoint` in 0.2.0.

Every name is still reachable here, with a `DeprecationWarning`, until annot 0.3.0
(CHANGELOG.md, "Deprecated"). Nothing inside annot imports this module.
"""

from __future__ import annotations

from typing import Any

from annot._deprecation import moved_attribute


def __getattr__(name: str) -> Any:
    from annot.runtime import activation_checkpoint

    return moved_attribute(__name__, activation_checkpoint, name)
