"""Deprecated import path: ``annot.loading`` moved to `annot.checkpoint_io.loading` in 0.2.0.

Every name is still reachable here, with a `DeprecationWarning`, until annot 0.3.0
(CHANGELOG.md, "Deprecated"). ``load`` leads to the public `annot.load`
(`annot.values`), which, as this module's did, finds where an engine keeps each
parameter itself. Nothing inside annot imports this module.
"""

from __future__ import annotations

from typing import Any

from annot._deprecation import moved_attribute


def __getattr__(name: str) -> Any:
    from annot import values
    from annot.checkpoint_io import loading

    return moved_attribute(__name__, values if name == 'load' else loading, name)
