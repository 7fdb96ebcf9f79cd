"""`installed`: skip a test module when an optional package is absent, without importing
the package at collection (lightning, accelerate and DeepSpeed take seconds to import,
and a session that deselects these tests should not pay for them)."""

from __future__ import annotations

import importlib.util

import pytest


def installed(*modules: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark naming whichever of ``modules`` cannot be found."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")
