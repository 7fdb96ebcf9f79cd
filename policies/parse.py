"""Rules from text, for the command line: ``class:Block | name:lm_head``.

Grammar (``&`` binds tighter than ``|`` and ``-``, which read left to right)::

    expr   := term (("|" | "-") term)*
    term   := factor ("&" factor)*
    factor := "(" expr ")" | "every(" INT "," expr ")" | atom
    atom   := "class:" NAME[,NAME...] | "name:" GLOB | "size:" COUNT | "marked" [":" ACTION]
              | "hf" | "repeated"

COUNT takes plain integers, ``1e8`` or suffixes K, M, B (``100M``).
"""

from __future__ import annotations

import re

from annot.policies.errors import AnnotError
from annot.policies.rules import (
    Rule,
    by_class,
    by_name,
    by_size,
    every_nth,
    marked,
    no_split_modules,
    repeated_blocks,
)

__all__ = ["PolicySyntaxError", "parse_count", "parse_rule"]

_TOKEN = re.compile(r"\s*(?:(every\()|([()|&,-])|([^\s()|&,-][^\s()|&,]*(?:,[^\s()|&,]+)*))")
_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


class PolicySyntaxError(AnnotError, ValueError):
    """A rule expression could not be read; the message says where."""


def parse_count(text: str) -> int:
    """``"100M"`` -> 100_000_000; ``"1e8"`` -> 100_000_000; ``"5000"`` -> 5000."""
    raw = text.strip().upper()
    scale = _SUFFIX.get(raw[-1:], 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise PolicySyntaxError(f"not a parameter count: {text!r} (try 100M, 1e8 or 5000)") from None
    if value < 1 or value != int(value):
        raise PolicySyntaxError(f"a parameter count must be a positive whole number: {text!r}")
    return int(value)


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise PolicySyntaxError(f"cannot read rule {text!r} at column {pos + 1}")
        tokens.append(next(g for g in match.groups() if g))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            want = f"{expected!r}" if expected else "more"
            raise PolicySyntaxError(f"in rule {self.text!r}: expected {want}, found {token or 'the end'!r}")
        self.i += 1
        return token

    def parse(self) -> Rule:
        rule = self.expr()
        if self.peek() is not None:
            raise PolicySyntaxError(f"in rule {self.text!r}: unexpected {self.peek()!r}")
        return rule

    def expr(self) -> Rule:
        rule = self.term()
        while self.peek() in ("|", "-"):
            op = self.take()
            other = self.term()
            rule = rule | other if op == "|" else rule - other
        return rule

    def term(self) -> Rule:
        rule = self.factor()
        while self.peek() == "&":
            self.take()
            rule = rule & self.factor()
        return rule

    def factor(self) -> Rule:
        token = self.peek()
        if token == "(":
            self.take()
            rule = self.expr()
            self.take(")")
            return rule
        if token == "every(":
            self.take()
            n = self.take()
            if "," in n:  # "every(2,class:Block)" arrives as one token
                n, rest = n.split(",", 1)
                self.tokens[self.i : self.i] = [",", rest]
            if not n.isdigit() or int(n) < 1:
                raise PolicySyntaxError(f"in rule {self.text!r}: every(N, ...) needs N >= 1, got {n!r}")
            self.take(",")
            rule = self.expr()
            self.take(")")
            return every_nth(int(n), rule)
        return self.atom(self.take())

    def atom(self, token: str) -> Rule:
        kind, _, value = token.partition(":")
        try:
            if kind == "class" and value:
                return by_class(*value.split(","))
            if kind == "name" and value:
                return by_name(*value.split(","))
            if kind == "size" and value:
                return by_size(parse_count(value))
            if kind == "marked":
                return marked(value or None)
            if kind == "hf" and not value:
                return no_split_modules()
            if kind == "repeated" and not value:
                return repeated_blocks()
        except ValueError as exc:
            if isinstance(exc, PolicySyntaxError):
                raise
            raise PolicySyntaxError(f"in rule {self.text!r}: {exc}") from None
        raise PolicySyntaxError(
            f"in rule {self.text!r}: unknown rule {token!r}; use class:NAME, name:GLOB, "
            "size:COUNT, marked[:ACTION], hf, repeated, every(N, RULE), with | & - ( )"
        )


def parse_rule(text: str) -> Rule:
    """Parse a rule expression (see the module docstring); raises `PolicySyntaxError`."""
    if not text or not text.strip():
        raise PolicySyntaxError("empty rule expression")
    return _Parser(text).parse()
