"""Exception types shared by `policies` and re-exported by `annot`.

`AnnotError` lives here, in the lowest package, so that every error the library
raises (plan validation included) can be caught with one ``except``.
"""

from __future__ import annotations

__all__ = ["AnnotError", "PlanError"]


class AnnotError(Exception):
    """Base class of every error annot raises on purpose."""


class PlanError(AnnotError, ValueError):
    """A policy or Plan is invalid for this model; the message names the modules and the fix."""
