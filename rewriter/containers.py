"""Which attribute of a module class holds which submodules, read from its methods.

``self.h = nn.ModuleList([Block(c) for _ in range(n)])``, ``nn.Sequential(*[...])``,
``nn.ModuleDict(dict(h=...))`` / ``nn.ModuleDict({"h": ...})``, ``self.layers.append(Block())``
after an empty ModuleList, ``self.layers[str(i)] = Block()`` into a ModuleDict, a list built
in a local first (``blocks = [Block() for ...]; self.blocks = nn.ModuleList(blocks)``) and
``self.block = Block()``. Every method counts, not only ``__init__`` (Lightning builds
layers in ``configure_model``). Class names go through the file's imports
(``from .blocks import Block as B``; ``B()`` builds a ``Block``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from annot.rewriter.imports import ImportTable, dotted_name

__all__ = ["Container", "child_nodes", "read_containers"]

_LISTS = {"ModuleList": "list", "Sequential": "sequential"}
# torch.nn classes that are blocks themselves; every other torch.nn class in a stack makes
# it a stack of layers (a helper MLP), not a trunk of blocks.
_BLOCK_LIKE = {
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
}


@dataclass(frozen=True)
class Container:
    """An attribute of ``self`` holding one module or a collection of them."""

    path: str
    kind: str  # "module" | "list" | "sequential" | "dict"
    classes: tuple[str, ...]  # element class names; () when the source does not say
    repeated: bool = False  # built from a comprehension, repetition or appends: a stack
    count: str | None = None  # how many, as written (`config.n_layer`), when known
    #: element by element classes when every element is itself a list of modules
    #: (``ModuleList([Attention(), FeedForward()])``): what tuple unpacking binds
    items: tuple[tuple[str, ...], ...] = ()
    #: some element is a torch.nn layer (Linear, SiLU, ...): a stack of layers, not blocks
    builtin: bool = False

    def item(self, index: int) -> Container:
        """The container one unpacked position of each element stands for."""
        return Container(
            f"{self.path}[i][{index}]",
            "list",
            self.items[index],
            self.repeated,
            self.count,
            builtin=False,
        )


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


@dataclass(frozen=True)
class _Elements:
    """What a list of element expressions says about the modules it builds."""

    classes: tuple[str, ...] = ()
    repeated: bool = False
    count: str | None = None
    items: tuple[tuple[str, ...], ...] = ()
    builtin: bool = False
    known: bool = False  # False: some element's class cannot be read from the source


_UNKNOWN = _Elements()


class _Reader:
    def __init__(self, module: cst.Module, table: ImportTable) -> None:
        self.module = module
        self.table = table
        self.containers: dict[str, Container] = {}
        self.self_name = "self"
        self.locals: dict[str, _Elements] = {}
        # containers built empty and not filled yet (`self.stages = nn.Sequential()` before
        # `self.stages = nn.Sequential(*stages)`, timm): a later build replaces them whole
        self.placeholders: set[str] = set()

    def _path(self, node: cst.BaseExpression) -> str | None:
        name = dotted_name(node)
        prefix = self.self_name + "."
        return name[len(prefix) :] if name and name.startswith(prefix) else None

    def _class(self, node: cst.Call) -> tuple[str, bool] | None:
        """(class name, is a torch.nn class) a constructor call builds, through aliases."""
        name = self.table.resolve(node.func) or dotted_name(node.func)
        if name is None:
            return None
        return name.rpartition(".")[2], name.startswith("torch.nn.")

    def _element(self, value: cst.BaseExpression) -> _Elements:
        """One element expression (a module, a nested list, a comprehension, ...)."""
        if isinstance(value, cst.List | cst.Tuple):
            return self._elements(
                [e.value for e in value.elements if isinstance(e, cst.Element | cst.StarredElement)]
            )
        if isinstance(value, cst.ListComp | cst.GeneratorExp):
            inner = self._element(value.elt)
            it = value.for_in.iter
            count = None
            if isinstance(it, cst.Call) and dotted_name(it.func) == "range" and len(it.args) == 1:
                count = self.module.code_for_node(it.args[0].value)
            return dataclasses.replace(inner, repeated=True, count=count)
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
            # [Block(c)] * n would share one module n times; treat the class as known.
            return dataclasses.replace(self._element(value.left), repeated=True)
        if isinstance(value, cst.IfExp):
            both = [self._element(v) for v in (value.body, value.orelse) if not _is_none(v)]
            return _merge(both) if both else _Elements(known=True)
        if isinstance(value, cst.Name) and value.value in self.locals:
            return self.locals[value.value]
        if not isinstance(value, cst.Call):
            return _UNKNOWN
        cls = self._class(value)
        if cls is None:
            return _UNKNOWN
        name, torch_nn = cls
        if name not in _LISTS:
            return _Elements((name,), builtin=torch_nn and name not in _BLOCK_LIKE, known=True)
        # A list of modules as one element (`ModuleList([Attention(), FeedForward()])`):
        # `for attn, ff in self.layers` unpacks it position by position.
        inner = self._elements([a.value for a in value.args if a.keyword is None])
        listed = _listed(value)
        items: tuple[tuple[str, ...], ...] = ()
        if listed is not None:
            per = [self._element(e) for e in listed]
            if per and all(p.known and p.classes for p in per):
                items = tuple(p.classes for p in per)
        return _Elements((name,), items=items, builtin=inner.builtin, known=True)

    def _elements(self, args: list[cst.BaseExpression]) -> _Elements:
        parts = [self._element(v) for v in args]
        return _merge(parts) if parts else _Elements(known=True)

    def assign(self, path: str, value: cst.BaseExpression) -> None:
        if not isinstance(value, cst.Call):
            return
        cls = self._class(value)
        kind = cls[0] if cls is not None else ""
        positional = [a.value for a in value.args if a.keyword is None]
        if kind in _LISTS:
            if kind == "Sequential" and any(
                isinstance(v, cst.Call) and (dotted_name(v.func) or "").endswith(("OrderedDict", "dict"))
                for v in positional
            ):
                self._set(Container(path, "sequential", ()))
                return
            if not positional:
                if path not in self.containers:
                    self._set(Container(path, _LISTS[kind], ()))
                    self.placeholders.add(path)
                return
            e = self._elements(positional)
            self._set(
                Container(
                    path,
                    _LISTS[kind],
                    e.classes if e.known else (),
                    e.repeated,
                    e.count,
                    e.items,
                    e.builtin,
                )
            )
        elif kind == "ModuleDict":
            values: list[cst.BaseExpression] = []
            for arg in value.args[:1]:
                items = arg.value
                if isinstance(items, cst.Call) and dotted_name(items.func) == "dict":
                    for kw in items.args:
                        if kw.keyword is not None:
                            self.assign(f"{path}.{kw.keyword.value}", kw.value)
                            values.append(kw.value)
                elif isinstance(items, cst.Dict):
                    for el in items.elements:
                        if (
                            isinstance(el, cst.DictElement)
                            and isinstance(el.key, cst.SimpleString)
                            and isinstance(key := el.key.evaluated_value, str)  # not b"..."
                        ):
                            self.assign(f"{path}.{key}", el.value)
                            values.append(el.value)
            e = self._elements(values)
            self._set(Container(path, "dict", e.classes if e.known else (), builtin=e.builtin))
        elif kind[:1].isupper():
            self._set(Container(path, "module", (kind,), builtin=cls is not None and cls[1]))

    def _set(self, c: Container) -> None:
        """Record ``c``; a second assignment of one path (``if``/``else`` branches building
        the same stack two ways) merges with the first."""
        old = self.containers.get(c.path)
        if c.path in self.placeholders:
            self.placeholders.discard(c.path)
            old = None
        if old is not None and old.kind == c.kind and c.kind != "module":
            c = Container(
                c.path,
                c.kind,
                tuple(dict.fromkeys(old.classes + c.classes)) if old.classes and c.classes else (),
                old.repeated or c.repeated,
                c.count or old.count,
                c.items if c.items == old.items else (),
                old.builtin or c.builtin,
            )
        self.containers[c.path] = c

    def add(self, path: str, value: cst.BaseExpression, *, many: bool = False) -> None:
        """``self.layers.append(Block())`` / ``.extend([...])`` / ``self.layers[k] = Block()``."""
        old = self.containers.get(path)
        if old is None or old.kind == "module":
            return
        e = self._element(value) if many else self._elements([value])
        fresh = not old.repeated and not old.classes  # `nn.ModuleList()` so far
        known = e.known and (fresh or bool(old.classes))
        merged = tuple(dict.fromkeys(old.classes + e.classes)) if known else ()
        items = e.items if fresh or old.items == e.items else ()
        builtin = old.builtin or e.builtin
        self.placeholders.discard(path)
        self.containers[path] = Container(path, old.kind, merged, True, old.count, items, builtin)

    def local(self, name: str, value: cst.BaseExpression | None, *, append: bool = False) -> None:
        """Lists of modules built in a local before they go into a container."""
        if append:
            old = self.locals.get(name)
            if old is not None and value is not None:
                new = self._element(value)
                self.locals[name] = dataclasses.replace(_merge([old, new]) if old.classes else new, repeated=True)
            return
        if isinstance(value, cst.List | cst.ListComp):
            self.locals[name] = self._element(value)
        else:
            self.locals.pop(name, None)

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
                        if small.value is None:
                            continue
                        path = self._path(target)
                        if path is not None:
                            self.assign(path, small.value)
                        elif isinstance(target, cst.Name):
                            self.local(target.value, small.value)
                        elif isinstance(target, cst.Subscript):
                            path = self._path(target.value)
                            if path is not None:
                                self.add(path, small.value)
                elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                    func = small.value.func
                    if (
                        isinstance(func, cst.Attribute)
                        and func.attr.value in ("append", "extend")
                        and small.value.args
                    ):
                        arg = small.value.args[0].value
                        many = func.attr.value == "extend"
                        path = self._path(func.value)
                        if path is not None:
                            self.add(path, arg, many=many)
                        elif isinstance(func.value, cst.Name):
                            self.local(func.value.value, arg, append=True)


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _listed(call: cst.Call) -> list[cst.BaseExpression] | None:
    """The element expressions of ``ModuleList([a, b])`` / ``Sequential(a, b)``; None when
    their number is not written out (a comprehension, ``*layers``)."""
    args = [a for a in call.args if a.keyword is None]
    if len(args) == 1 and isinstance(args[0].value, cst.List | cst.Tuple):
        elements = args[0].value.elements
        if all(isinstance(e, cst.Element) for e in elements):
            return [e.value for e in elements]
        return None
    if any(a.star for a in args) or any(
        isinstance(a.value, cst.List | cst.Tuple | cst.ListComp | cst.GeneratorExp | cst.Name)
        for a in args
    ):
        return None
    return [a.value for a in args]


def _merge(parts: list[_Elements]) -> _Elements:
    known = all(p.known for p in parts)
    items = parts[0].items if all(p.items == parts[0].items for p in parts) else ()
    return _Elements(
        tuple(dict.fromkeys(c for p in parts for c in p.classes)),
        any(p.repeated for p in parts),
        next((p.count for p in parts if p.count), None),
        items,
        any(p.builtin for p in parts),
        known,
    )


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


def first_param(method: cst.FunctionDef) -> str | None:
    """The name ``self`` has in ``method``; None for static and class methods."""
    for dec in method.decorators:
        if (dotted_name(dec.decorator) or "").rpartition(".")[2] in ("staticmethod", "classmethod"):
            return None
    params = method.params.posonly_params or method.params.params
    return params[0].name.value if params else None


def read_containers(
    module: cst.Module, table: ImportTable, methods: list[cst.FunctionDef]
) -> dict[str, Container]:
    """Attribute path (``transformer.h``) -> what the class's methods assign there
    (``__init__`` first, then the others in source order)."""
    reader = _Reader(module, table)
    ordered = sorted(methods, key=lambda m: m.name.value != "__init__")
    for method in ordered:
        self_name = first_param(method)
        if self_name is None:
            continue
        reader.self_name = self_name
        reader.locals = {}
        reader.read(method.body)
    return reader.containers
