"""Line and column of a few nodes of a module, cheaply.

libcst's PositionProvider records a position for every node and costs several plain
codegens of the module; a rewrite needs a handful of positions (one per site). `generate`
writes the rewritten module once and, on the way, works out where the wanted (original,
unchanged) nodes stood in the input: it subtracts the lines annot inserted before them.
`locate` does the same on an unchanged module and stops after the last wanted node.
``CodegenState`` is libcst-internal: if it moves, fall back to the provider.
"""

from __future__ import annotations

import libcst as cst

try:
    from libcst._nodes.internal import CodegenState
except ImportError:  # pragma: no cover - depends on libcst internals
    CodegenState = None  # type: ignore[assignment,misc]

__all__ = ["generate", "locate"]


class _AllFound(Exception):
    pass


def _with_provider(module: cst.Module, nodes: list[cst.CSTNode]) -> dict[int, tuple[int, int]]:
    from libcst.metadata import MetadataWrapper, PositionProvider

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    return {id(n): (positions[n].start.line, positions[n].start.column + 1) for n in nodes}


def locate(module: cst.Module, nodes: list[cst.CSTNode]) -> dict[int, tuple[int, int]]:
    """1-based (line, column) where each of ``nodes`` (nodes of ``module``) starts, by id."""
    if not nodes:
        return {}
    if CodegenState is None:  # pragma: no cover
        return _with_provider(module, nodes)
    state = _Locator(module, {id(n) for n in nodes})
    try:
        module._codegen(state)
    except _AllFound:
        pass
    if len(state.found) != len(state.wanted):  # pragma: no cover - a node not in the module
        return _with_provider(module, nodes)
    return state.found


if CodegenState is not None:

    class _Locator(CodegenState):
        """Plain codegen that notes where wanted nodes start, in the *input's* lines.

        ``inserted``: ids of whole statements annot added (import lines).
        ``guards``: id of each inserted guard's test -> id of the original statement in
        its ``else``; everything from the ``if`` line to that statement is inserted, and
        the statement's lines (continuation lines too) are indented one level more than
        in the input.
        """

        def __init__(
            self,
            module: cst.Module,
            wanted: set[int],
            inserted: set[int] = frozenset(),  # type: ignore[assignment]
            guards: dict[int, int] | None = None,
            stop_early: bool = True,
        ) -> None:
            super().__init__(
                default_indent=module.default_indent, default_newline=module.default_newline
            )
            self.wanted, self.inserted, self.guards = wanted, inserted, guards or {}
            self.stop_early = stop_early
            self.indent = len(module.default_indent)
            self.found: dict[int, tuple[int, int]] = {}
            self.upto, self.line, self.tail = 0, 1, ""
            self.offset = 0  # lines inserted so far
            self.mark = 0  # output line where the current inserted region began
            self.in_guard: int | None = None  # the original statement we wait for
            self.shifted: int | None = None  # the original statement being written

        def advance(self) -> None:
            text = "".join(self.tokens[self.upto :])
            self.upto = len(self.tokens)
            newlines = text.count("\n")
            self.line += newlines
            self.tail = text.rpartition("\n")[2] if newlines else self.tail + text

        def before_codegen(self, node: cst.CSTNode) -> None:
            key = id(node)
            if key in self.guards:
                self.advance()
                self.mark, self.in_guard = self.line, self.guards[key]
            elif key == self.in_guard:
                self.advance()
                self.offset += self.line - self.mark
                self.in_guard, self.shifted = None, key
            elif key in self.inserted:
                self.advance()
                self.mark = self.line
            elif key in self.wanted and key not in self.found and self.in_guard is None:
                self.advance()
                column = len(self.tail) + 1
                if self.shifted is not None:
                    column = max(1, column - self.indent)
                self.found[key] = (self.line - self.offset, column)
                if self.stop_early and len(self.found) == len(self.wanted):
                    raise _AllFound

        def after_codegen(self, node: cst.CSTNode) -> None:
            if id(node) == self.shifted:
                self.shifted = None
            elif id(node) in self.inserted:
                self.advance()
                self.offset += self.line - self.mark


def generate(
    module: cst.Module,
    nodes: list[cst.CSTNode],
    inserted: list[cst.BaseStatement],
    guards: dict[int, int],
) -> tuple[str, dict[int, tuple[int, int]]]:
    """``module.code``, and where ``nodes`` started in the source before annot's insertions
    (``inserted`` statements; ``guards``: guard-test id -> id of the original statement)."""
    if CodegenState is None:  # pragma: no cover
        return module.code, {}
    state = _Locator(module, {id(n) for n in nodes}, {id(s) for s in inserted}, guards, False)
    module._codegen(state)
    return "".join(state.tokens), state.found
