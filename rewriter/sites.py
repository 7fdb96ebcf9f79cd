"""Find the block calls in ``forward`` methods that can be checkpointed, and why others can't.

What each attribute holds comes from the class's own ``__init__`` (`rewriter.containers`).
A `Selector` decides which of those hold blocks: the marked classes / ``--blocks`` names,
or, with neither, the trunk (a ModuleList iterated in ``forward``, or a Sequential built
from a repeated block and called whole).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeGuard

import libcst as cst

from annot.rewriter.containers import Container, child_nodes, read_containers
from annot.rewriter.imports import ImportTable, dotted_name

__all__ = ["Container", "Found", "Selector", "Skipped", "is_annot_guard", "scan_module"]

GUARD_MARKER = "# annot: checkpoint"

_KNOWN_CHECKPOINTS = {
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
    "deepspeed.checkpointing.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
}
# timm's helper lives in a private module that moved between releases; match its name.
_KNOWN_CHECKPOINT_TAILS = {"checkpoint_seq", "checkpoint_sequential"}
# Keyword arguments whose state a recomputation in backward would update a second time.
_REPLAYED_STATE = {
    "use_cache",
    "past_key_values",
    "past_key_value",
    "layer_past",
    "cache",
    "kv_cache",
    "inference_params",
}
_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)
_PASS_THROUGH_ITERS = {"reversed", "list", "tuple", "iter"}


@dataclass(frozen=True)
class Selector:
    """Which containers hold blocks: by class name, or (``classes is None``) the trunk."""

    classes: frozenset[str] | None = None

    def holds_blocks(self, c: Container, *, called_whole: bool = False) -> bool:
        if self.classes is None:
            if c.kind == "list":
                return not called_whole
            return c.kind == "sequential" and c.repeated
        return bool(c.classes) and all(name in self.classes for name in c.classes)

    def describe(self) -> str:
        if self.classes is None:
            return "trunk (ModuleList/Sequential of repeated layers called from forward)"
        return "classes " + ", ".join(sorted(self.classes))


@dataclass
class Found:
    """One call to wrap; ``path`` runs from the module down to the call node."""

    path: tuple[cst.CSTNode, ...]
    statement: cst.SimpleStatementLine
    call: cst.Call
    shape: str  # "loop" | "indexed" | "attribute" | "sequential"
    function: str
    container: Container
    warning: str | None = None
    # DeepSpeed hands back a 1-tuple's element bare: re-tuple where the caller indexes.
    retuple_name: str | None = None
    hoist: bool = False


@dataclass(frozen=True)
class Skipped:
    node: cst.CSTNode
    function: str
    block: str
    reason: str


@dataclass
class FunctionScan:
    found: list[Found] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    self_name: str = "self"


def is_annot_guard(node: cst.CSTNode) -> TypeGuard[cst.If]:
    """True for the ``if ...:  # annot: checkpoint`` statements annot inserts."""
    if not isinstance(node, cst.If) or not isinstance(node.body, cst.IndentedBlock):
        return False
    comment = node.body.header.comment
    return (
        comment is not None
        and comment.value.startswith(GUARD_MARKER)
        and isinstance(node.orelse, cst.Else)
        and isinstance(node.orelse.body, cst.IndentedBlock)
        and len(node.orelse.body.body) == 1
    )


# -- forward: where blocks are called --------------------------------------------------------


def _is_int_index(node: cst.Subscript) -> bool:
    if len(node.slice) != 1:
        return False
    sl = node.slice[0].slice

    def is_int(e: cst.BaseExpression | None) -> bool:
        if e is None or isinstance(e, cst.Integer):
            return True
        return isinstance(e, cst.UnaryOperation) and isinstance(e.expression, cst.Integer)

    if isinstance(sl, cst.Index):
        return isinstance(sl.value, cst.Integer | cst.UnaryOperation) and is_int(sl.value)
    return isinstance(sl, cst.Slice) and is_int(sl.lower) and is_int(sl.upper)


class _ForwardScan:
    def __init__(
        self,
        module: cst.Module,
        table: ImportTable,
        containers: dict[str, Container],
        selector: Selector,
        function: cst.FunctionDef,
        qualname: str,
        target: str,
        functional: bool,
        root_path: tuple[cst.CSTNode, ...],
    ) -> None:
        self.module = module
        self.table = table
        self.containers = containers
        self.selector = selector
        self.function = function
        self.qualname = qualname
        self.target = target
        self.functional = functional
        self.stack: list[cst.CSTNode] = list(root_path)
        self.base = len(root_path)
        self.result = FunctionScan()
        params = function.params.params or function.params.posonly_params
        self.result.self_name = params[0].name.value if params else "self"
        self.self_name = self.result.self_name
        self.int_indexed: set[str] = set()
        self.loops: dict[int, tuple[cst.For, str]] = {}  # loops over blocks, by id
        self.loops_calling: set[int] = set()
        self._ckpt_cache: dict[int, bool] = {}

    # -- helpers -----------------------------------------------------------------------
    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def container_of(self, expr: cst.BaseExpression) -> Container | None:
        name = dotted_name(expr)
        prefix = self.self_name + "."
        if name is None or not name.startswith(prefix):
            return None
        return self.containers.get(name[len(prefix) :])

    def pattern(self, expr: cst.BaseExpression) -> object:
        """Container, tuple of patterns, or None: what iterating ``expr`` yields."""
        c = self.container_of(expr)
        if c is not None:
            return c if c.kind != "module" else None
        if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
            if isinstance(expr.slice[0].slice, cst.Slice):
                return self.pattern(expr.value)
            return None
        if isinstance(expr, cst.Call):
            name = dotted_name(expr.func)
            args = [a.value for a in expr.args if a.keyword is None and not a.star]
            if name == "enumerate" and args:
                return (None, self.pattern(args[0]))
            if name == "zip":
                return tuple(self.pattern(a) for a in args)
            if name in _PASS_THROUGH_ITERS and len(args) == 1:
                return self.pattern(args[0])
        return None

    def bind(
        self, target: cst.BaseExpression, pattern: object, out: dict[str, Container | None]
    ) -> None:
        if isinstance(target, cst.Name):
            out[target.value] = pattern if isinstance(pattern, Container) else None
        elif isinstance(target, cst.Tuple | cst.List):
            elements = [e.value for e in target.elements]
            parts = pattern if isinstance(pattern, tuple) and len(pattern) == len(elements) else ()
            for i, el in enumerate(elements):
                self.bind(el, parts[i] if parts else None, out)

    def bindings_at(self, depth: int) -> dict[str, Container | None]:
        node = self.stack[depth]
        child = self.stack[depth + 1] if depth + 1 < len(self.stack) else None
        out: dict[str, Container | None] = {}
        if isinstance(node, cst.For) and child is node.body:
            self.bind(node.target, self.pattern(node.iter), out)
        elif isinstance(node, _COMPREHENSIONS):
            comp: cst.CompFor | None = node.for_in
            while comp is not None:
                self.bind(comp.target, self.pattern(comp.iter), out)
                comp = comp.inner_for_in
        elif isinstance(node, cst.Lambda) and depth >= 2:
            arg, call = self.stack[depth - 1], self.stack[depth - 2]
            params = node.params.params
            if (
                isinstance(call, cst.Call)
                and isinstance(arg, cst.Arg)
                and (dotted_name(call.func) or "").endswith("reduce")
                and len(call.args) >= 2
                and call.args[0] is arg
                and len(params) == 2
            ):
                out[params[0].name.value] = None
                pat = self.pattern(call.args[1].value)
                out[params[1].name.value] = pat if isinstance(pat, Container) else None
            else:
                for p in params:
                    out[p.name.value] = None
        return out

    def lookup(self, name: str) -> tuple[Container | None, int]:
        for depth in range(len(self.stack) - 1, self.base - 1, -1):
            bound = self.bindings_at(depth)
            if name in bound:
                return bound[name], depth
        return None, -1

    def known_checkpoint(self, func: cst.BaseExpression) -> str | None:
        if isinstance(func, cst.Attribute) and func.attr.value == "_gradient_checkpointing_func":
            return "transformers' _gradient_checkpointing_func"
        qualified = self.table.resolve(func)
        if qualified is None:
            return None
        if (
            qualified in _KNOWN_CHECKPOINTS
            or qualified.rpartition(".")[2] in _KNOWN_CHECKPOINT_TAILS
        ):
            return qualified
        return None

    def contains_checkpoint(self, node: cst.CSTNode | None) -> bool:
        if node is None:
            return False
        key = id(node)
        if key not in self._ckpt_cache:
            self._ckpt_cache[key] = any(
                isinstance(n, cst.Call) and self.known_checkpoint(n.func) is not None
                for n in _descendants(node)
            )
        return self._ckpt_cache[key]

    def block_of(self, expr: cst.BaseExpression) -> tuple[Container | None, int]:
        """The container a callee or argument refers to a block of, and the binding depth."""
        if isinstance(expr, cst.Attribute) and expr.attr.value in ("__call__", "forward"):
            expr = expr.value
        if isinstance(expr, cst.Name):
            return self.lookup(expr.value)
        c = self.container_of(expr)
        if c is not None:
            return c, -1
        if isinstance(expr, cst.Subscript):
            c = self.container_of(expr.value)
            if c is not None and c.kind != "module":
                return c, -1
        return None, -1

    def skip(self, node: cst.CSTNode, block: cst.CSTNode, reason: str) -> None:
        self.result.skipped.append(Skipped(node, self.qualname, self.code(block), reason))

    def note_loop_call(self, depth: int) -> None:
        if depth >= 0:
            self.loops_calling.add(id(self.stack[depth]))

    # -- visiting ----------------------------------------------------------------------
    def walk(self, node: cst.CSTNode) -> None:
        self.stack.append(node)
        if self.enter(node):
            for child in child_nodes(node):
                self.walk(child)
        self.stack.pop()

    def enter(self, node: cst.CSTNode) -> bool:
        """Note what ``node`` says; False: do not look inside."""
        if is_annot_guard(node):
            self.skip(node.test, node.orelse.body.body[0], "already rewritten by annot")  # type: ignore[union-attr]
            for n in self.stack:
                self.loops_calling.add(id(n))
            return False
        if isinstance(node, cst.Name):
            self.result.names.add(node.value)
        elif isinstance(node, cst.Subscript):
            if isinstance(node.value, cst.Name) and _is_int_index(node):
                self.int_indexed.add(node.value.value)
        elif isinstance(node, cst.For):
            pat = self.pattern(node.iter)
            bound: dict[str, Container | None] = {}
            self.bind(node.target, pat, bound)
            for c in bound.values():
                if c is not None and self.selector.holds_blocks(c):
                    self.loops[id(node)] = (node, self.self_name + "." + c.path)
        elif isinstance(node, cst.Call):
            self.visit_call(node)
        return True

    def visit_call(self, call: cst.Call) -> None:
        ckpt = self.known_checkpoint(call.func)
        if ckpt is not None:
            for arg in call.args:
                c, depth = self.block_of(arg.value)
                if c is not None and self.selector.holds_blocks(c):
                    self.note_loop_call(depth)
                    self.skip(call, arg.value, f"already checkpointed by {ckpt}")
                    return
            return
        if (dotted_name(call.func) or "").rpartition(".")[2] == "checkpoint":
            for arg in call.args:
                c, depth = self.block_of(arg.value)
                if c is not None and self.selector.holds_blocks(c):
                    self.note_loop_call(depth)
                    self.skip(
                        call,
                        arg.value,
                        f"passed to `{self.code(call.func)}`, which is not a known checkpoint function; left alone",
                    )
                    return
        func = call.func
        shape: str
        if isinstance(func, cst.Name):
            c, depth = self.lookup(func.value)
            if c is None or not self.selector.holds_blocks(c):
                return
            self.note_loop_call(depth)
            shape = "loop"
        elif isinstance(func, cst.Subscript):
            c = self.container_of(func.value)
            if c is None or c.kind == "module" or not self.selector.holds_blocks(c):
                return
            shape = "indexed"
        else:
            c = self.container_of(func)
            if c is None:
                return
            if c.kind == "module":
                if self.selector.classes is None or not self.selector.holds_blocks(c):
                    return
                shape = "attribute"
            else:
                if not self.selector.holds_blocks(c, called_whole=True):
                    return
                shape = "sequential"
        self.site(call, c, shape)

    def site(self, call: cst.Call, c: Container, shape: str) -> None:
        stack = self.stack
        stmt_depth = None
        for depth in range(len(stack) - 2, self.base - 1, -1):
            node = stack[depth]
            if isinstance(node, (*_COMPREHENSIONS, cst.Lambda)) and not self.functional:
                form = (
                    "a comprehension"
                    if not isinstance(node, cst.Lambda)
                    else "a lambda (functools.reduce form)"
                )
                return self.skip(call, call.func, f"inside {form}; opt in with --functional")
            if isinstance(node, cst.SimpleStatementLine | cst.SimpleStatementSuite):
                stmt_depth = depth
                break
            if isinstance(node, cst.BaseCompoundStatement):
                return self.skip(
                    call, call.func, "in the header of a compound statement; not wrapped"
                )
        if stmt_depth is None:
            return
        if any(isinstance(n, cst.FunctionDef) for n in stack[self.base + 1 : stmt_depth]):
            return self.skip(call, call.func, "inside a nested function; not wrapped")
        stmt = stack[stmt_depth]
        if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(
            stack[stmt_depth - 1], cst.IndentedBlock
        ):
            return self.skip(
                call,
                call.func,
                "on the same line as its `for`/`if`; put it on its own line to wrap it",
            )
        if len(stmt.body) != 1:
            return self.skip(
                call, call.func, "shares its line with other statements (`;`); not wrapped"
            )
        for depth in range(self.base, stmt_depth):
            node, child = stack[depth], stack[depth + 1]
            if isinstance(node, cst.If):
                sibling = (
                    node.orelse
                    if child is node.body
                    else node.body
                    if child is node.orelse
                    else None
                )
                if self.contains_checkpoint(sibling):
                    return self.skip(
                        call, call.func, "the other branch of this `if` already checkpoints it"
                    )
        if self.target == "deepspeed" and any(
            a.keyword is not None and a.keyword.value == "function" for a in call.args
        ):
            return self.skip(
                call, call.func, "passes `function=`, which deepspeed's checkpoint takes itself"
            )
        replayed = sorted(
            a.keyword.value
            for a in call.args
            if a.keyword is not None and a.keyword.value in _REPLAYED_STATE
        )
        warning = None
        if replayed:
            warning = (
                f"passes {', '.join(replayed)}: recomputation in backward runs the block again; "
                "make sure no cache is updated in training"
            )
        found = Found(tuple(stack), stmt, call, shape, self.qualname, c, warning)
        if self.target == "deepspeed" and shape != "sequential":
            parent = stack[-2]
            small = stmt.body[0]
            if isinstance(parent, cst.Subscript) and parent.value is call and _is_int_index(parent):
                found.hoist = True
            elif (
                isinstance(small, cst.Assign)
                and small.value is call
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)
            ):
                found.retuple_name = small.targets[0].target.value
        self.result.found.append(found)

    def finish(self) -> FunctionScan:
        for key, (loop, container) in self.loops.items():
            if key not in self.loops_calling:
                self.skip(
                    loop.target, loop.target, f"loop over {container} does not call its element"
                )
        for f in self.result.found:
            if f.retuple_name is not None and f.retuple_name not in self.int_indexed:
                f.retuple_name = None
        return self.result


def _descendants(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for child in child_nodes(node):
        yield from _descendants(child)


def scan_module(
    module: cst.Module,
    table: ImportTable,
    selector: Selector,
    *,
    target: str,
    functional: bool = False,
) -> tuple[list[FunctionScan], list[Container]]:
    """Scan every ``forward`` of every class at module level (or nested in classes)."""
    scans: list[FunctionScan] = []
    chosen: list[Container] = []

    def visit_class(cls: cst.ClassDef, path: tuple[cst.CSTNode, ...], prefix: str) -> None:
        body = cls.body
        if not isinstance(body, cst.IndentedBlock):
            return
        methods = {s.name.value: s for s in body.body if isinstance(s, cst.FunctionDef)}
        forward = methods.get("forward")
        inner_path = (*path, cls, body)
        for s in body.body:
            if isinstance(s, cst.ClassDef):
                visit_class(s, inner_path, f"{prefix}{cls.name.value}.")
        if forward is None:
            return
        containers = read_containers(module, table, methods.get("__init__"))
        scan = _ForwardScan(
            module,
            table,
            containers,
            selector,
            forward,
            f"{prefix}{cls.name.value}.forward",
            target,
            functional,
            (*inner_path,),
        )
        scan.walk(forward)
        result = scan.finish()
        scans.append(result)
        used = {id(f.container) for f in result.found}
        chosen.extend(c for c in containers.values() if id(c) in used)

    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            visit_class(stmt, (module,), "")
    return scans, chosen
