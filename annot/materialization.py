"""Deprecated import path: ``annot.materialization`` moved to `annot.meta.materialization` in 0.2.0.

Every name is still reachable here, with a `DeprecationWarning`, until annot 0.3.0
(CHANGELOG.md, "Deprecated"). ``materialize`` leads to the public `annot.materialize`
(`annot.values`), which, as this module's did, finds where an engine keeps each
parameter itself. Nothing inside annot imports this module.
"""

from __future__ import annotations

from typing import Any

from annot._deprecation import moved_attribute


def __getattr__(name: str) -> Any:
    from annot import values
    from annot.meta import materialization

    return moved_attribute(__name__, values if name == 'materialize' else materialization, name)
