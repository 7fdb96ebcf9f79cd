"""Which attribute of a module class holds which submodules, read from its ``__init__``.

``self.h = nn.ModuleList([Block(c) for _ in range(n)])``, ``nn.Sequential(*[...])``,
``nn.ModuleDict(dict(h=...))`` / ``nn.ModuleDict({"h": ...})``, ``self.layers.append(Block())``
after an empty ModuleList, and ``self.block = Block()``. Class names go through the
file's imports (``from .blocks import Block as B``; ``B()`` builds a ``Block``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from annot.rewriter.imports import ImportTable, dotted_name

__all__ = ["Container", "child_nodes", "read_containers"]


@dataclass(frozen=True)
class Container:
    """An attribute of ``self`` built in ``__init__``: one module or a list of them."""

    path: str
    kind: str  # "module" | "list" | "sequential"
    classes: tuple[str, ...]  # element class names; () when the source does not say
    repeated: bool = False  # built from a comprehension or repetition: a stack of layers
    count: str | None = None  # how many, as written (`config.n_layer`), when known


# Fields that only hold whitespace, punctuation or comments: never worth walking into.
_SKIPPED_FIELDS = {
    "lpar",
    "rpar",
    "leading_lines",
    "lines_after_decorators",
    "comma",
    "semicolon",
    "header",
    "footer",
    "equal",
    "colon",
    "dot",
    "operator",
    "lbracket",
    "rbracket",
    "lbrace",
    "rbrace",
    "trailing_whitespace",
    "asynchronous",
    "star_tok",
}
_FIELDS: dict[type, tuple[str, ...]] = {}


def child_nodes(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Syntactic children of ``node`` (no whitespace). libcst's visitors rebuild every node
    they pass, which costs more than the rest of a rewrite; reading fields does not."""
    names = _FIELDS.get(type(node))
    if names is None:
        names = tuple(
            f.name
            for f in dataclasses.fields(node)
            if f.name not in _SKIPPED_FIELDS and "whitespace" not in f.name
        )
        _FIELDS[type(node)] = names
    for name in names:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            yield value
        elif isinstance(value, tuple | list):
            for v in value:
                if isinstance(v, cst.CSTNode):
                    yield v


def _class_of(node: cst.BaseExpression, table: ImportTable | None = None) -> str | None:
    """The class a constructor call builds, through import aliases (``B()`` -> ``Block``)."""
    if isinstance(node, cst.Call):
        name = (table.resolve(node.func) if table is not None else None) or dotted_name(node.func)
        if name is not None:
            return name.rpartition(".")[2]
    return None


class _InitReader:
    def __init__(self, module: cst.Module, self_name: str, table: ImportTable) -> None:
        self.module = module
        self.self_name = self_name
        self.table = table
        self.containers: dict[str, Container] = {}

    def _path(self, node: cst.BaseExpression) -> str | None:
        name = dotted_name(node)
        prefix = self.self_name + "."
        return name[len(prefix) :] if name and name.startswith(prefix) else None

    def _elements(self, args: list[cst.BaseExpression]) -> tuple[tuple[str, ...], bool, str | None]:
        """(classes, repeated, count) of a list of element expressions."""
        classes: list[str] = []
        repeated = False
        count: str | None = None
        for value in args:
            if isinstance(value, cst.List | cst.Tuple):
                inner, rep, cnt = self._elements(
                    [
                        e.value
                        for e in value.elements
                        if isinstance(e, cst.Element | cst.StarredElement)
                    ]
                )
                classes += inner
                repeated, count = repeated or rep, count or cnt
            elif isinstance(value, cst.ListComp | cst.GeneratorExp):
                cls = _class_of(value.elt, self.table)
                if cls is None:
                    return (), False, None
                classes.append(cls)
                repeated = True
                it = value.for_in.iter
                if (
                    isinstance(it, cst.Call)
                    and dotted_name(it.func) == "range"
                    and len(it.args) == 1
                ):
                    count = self.module.code_for_node(it.args[0].value)
            elif isinstance(value, cst.BinaryOperation) and isinstance(
                value.operator, cst.Multiply
            ):
                # [Block(c)] * n would share one module n times; treat the class as known.
                inner, _, _ = self._elements([value.left])
                classes += inner
                repeated = True
            else:
                cls = _class_of(value, self.table)
                if cls is None:
                    return (), False, None
                classes.append(cls)
        return tuple(dict.fromkeys(classes)), repeated, count

    def assign(self, path: str, value: cst.BaseExpression) -> None:
        if not isinstance(value, cst.Call):
            return
        kind = (dotted_name(value.func) or "").rpartition(".")[2]
        positional = [a.value for a in value.args if a.keyword is None]
        if kind in ("ModuleList", "Sequential"):
            if kind == "Sequential" and any(
                (_class_of(v) or "") in ("OrderedDict", "dict") for v in positional
            ):
                self.containers[path] = Container(path, "sequential", ())
                return
            classes, repeated, count = self._elements(positional)
            kind = "list" if kind == "ModuleList" else "sequential"
            self.containers[path] = Container(path, kind, classes, repeated, count)
        elif kind == "ModuleDict":
            for arg in value.args[:1]:
                items = arg.value
                if isinstance(items, cst.Call) and dotted_name(items.func) == "dict":
                    for kw in items.args:
                        if kw.keyword is not None:
                            self.assign(f"{path}.{kw.keyword.value}", kw.value)
                elif isinstance(items, cst.Dict):
                    for el in items.elements:
                        if (
                            isinstance(el, cst.DictElement)
                            and isinstance(el.key, cst.SimpleString)
                            and isinstance(key := el.key.evaluated_value, str)  # not b"..."
                        ):
                            self.assign(f"{path}.{key}", el.value)
        elif kind[:1].isupper():
            self.containers[path] = Container(
                path, "module", (_class_of(value, self.table) or kind,)
            )

    def append(self, path: str, value: cst.BaseExpression) -> None:
        """``self.layers.append(Block())`` / ``.extend([...])`` after an empty ModuleList."""
        old = self.containers.get(path)
        if old is None or old.kind == "module":
            return
        classes, _, _ = self._elements([value])
        merged = tuple(dict.fromkeys(old.classes + classes)) if classes else ()
        self.containers[path] = Container(path, old.kind, merged, True, old.count)

    def read(self, body: cst.BaseSuite) -> None:
        for stmt in _statements(body):
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Assign | cst.AnnAssign):
                    targets = (
                        [t.target for t in small.targets]
                        if isinstance(small, cst.Assign)
                        else [small.target]
                    )
                    for target in targets:
                        path = self._path(target)
                        if path is not None and small.value is not None:
                            self.assign(path, small.value)
                elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                    func = small.value.func
                    if (
                        isinstance(func, cst.Attribute)
                        and func.attr.value in ("append", "extend")
                        and small.value.args
                    ):
                        path = self._path(func.value)
                        if path is not None:
                            self.append(path, small.value.args[0].value)


def _suites(stmt: cst.BaseStatement) -> Iterator[cst.BaseSuite]:
    """The bodies of a compound statement (``else``/``except``/``finally`` included)."""
    for name in ("body", "orelse", "handlers", "finalbody"):
        value = getattr(stmt, name, None)
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, cst.BaseSuite):
                yield v
            elif isinstance(v, cst.If):
                yield cst.IndentedBlock(body=[v])
            elif isinstance(v, cst.CSTNode) and isinstance(suite := getattr(v, "body", None), cst.BaseSuite):
                yield suite  # Else, ExceptHandler, Finally


def _statements(body: cst.BaseSuite) -> Iterator[cst.BaseStatement]:
    """Statements of a suite, descending into compound statements but not nested defs."""
    if not isinstance(body, cst.IndentedBlock):
        if isinstance(body, cst.SimpleStatementSuite):
            yield cst.SimpleStatementLine(body=body.body)
        return
    for stmt in body.body:
        yield stmt
        if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
            continue
        for suite in _suites(stmt):
            yield from _statements(suite)


def read_containers(
    module: cst.Module, table: ImportTable, init: cst.FunctionDef | None
) -> dict[str, Container]:
    """Attribute path (``transformer.h``) -> what ``init`` assigns there."""
    if init is None:
        return {}
    params = init.params.params
    reader = _InitReader(module, params[0].name.value if params else "self", table)
    reader.read(init.body)
    return reader.containers
