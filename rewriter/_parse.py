"""libcst's parser, behind the check CPython's own parser makes first."""

from __future__ import annotations

import ast

import libcst as cst

__all__ = ["parse_module"]


def parse_module(text: str) -> cst.Module:
    """``libcst.parse_module(text)``, after refusing (``RecursionError``) nesting deeper
    than CPython's parser allows: libcst's native parser can overflow the C stack on such
    input and kill the process (3000 nested parentheses did, under ``annot rewrite -j 1``).
    Other syntax errors are left to libcst, whose messages point at the spot."""
    try:
        ast.parse(text)
    except SyntaxError as e:
        if "too many" in str(e.msg):  # "too many nested parentheses", "... levels of indentation"
            raise RecursionError(e.msg) from None
    return cst.parse_module(text)
