"""Find the block calls in a module class's methods that can be checkpointed, and why
others can't.

What each attribute holds comes from the class's own methods (`rewriter.containers`).
A `Selector` decides which of those hold blocks: the marked classes / ``--blocks`` names,
or, with neither, the trunk (a ModuleList / ModuleDict iterated in a method, or a
Sequential built from a repeated block and called whole; never a stack of torch.nn
layers). In trunk mode the outermost trunk wins: a loop inside a class whose instances
are themselves checkpointed is reported, not wrapped a second time.

Also reported, not wrapped (docs/design.md, pitfall 31): a call of a class that
checkpoints inside itself (`checkpointers`), an MoE expert dispatch in trunk mode
(`dispatch`), and a loop that reaches a block container only through local names or
unpacking (x-transformers' ``zip(*layer_variables)``), which cannot be followed to the
call. A wrapped call passing a ``use_cache`` that is on by default carries why
(`cache_flags`), so the command line can say that training must turn it off.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeGuard

import libcst as cst

from annot.rewriter.cache_flags import flag_on_by_default
from annot.rewriter.checkpointers import checkpoint_function, self_checkpointing
from annot.rewriter.containers import Container, child_nodes, first_param, read_containers
from annot.rewriter.dispatch import expert_dispatch, holds_experts
from annot.rewriter.imports import ImportTable, dotted_name

__all__ = ["Container", "Found", "Selector", "Skipped", "is_annot_guard", "scan_module"]

GUARD_MARKER = "# annot: checkpoint"

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
        return self.why_not(c, called_whole=called_whole) is None

    def why_not(self, c: Container, *, called_whole: bool = False) -> str | None:
        """None when ``c`` holds blocks, else why not (for the report)."""
        if self.classes is not None:
            if c.classes and all(name in self.classes for name in c.classes):
                return None
            what = ", ".join(c.classes) if c.classes else "of classes the source does not name"
            return f"elements are {what}, none of the selected classes"
        if c.builtin:
            return (
                f"elements are torch.nn layers ({', '.join(c.classes)}), not a stack of blocks; "
                "--blocks NAME to wrap them"
            )
        if c.kind == "list":
            return None if not called_whole else "a ModuleList called whole"
        if c.kind == "dict":
            return None if c.repeated or len(c.classes) == 1 else "a ModuleDict of different modules"
        if c.kind == "sequential":
            return None if c.repeated else "a Sequential not built from a repeated block"
        return "a single module, not a stack (--blocks NAME to wrap it)"

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
    #: extra guard tests (code) that keep a KV cache out of recomputation
    conditions: tuple[str, ...] = ()
    #: how many times one run of the method makes this call, as code (`config.n_layer`)
    times: str = "1"
    #: the class whose method makes the call
    owner: str = ""
    #: why the cache flag the guard tests is on unless the caller turns it off (the guard
    #: then skips recomputation in a training run that keeps the default)
    cache_flag_on: str | None = None


@dataclass(frozen=True)
class Skipped:
    node: cst.CSTNode
    function: str
    block: str
    reason: str
    #: a selected block (marked or --blocks) is called here unprotected: `--check` fails
    unprotected: bool = False


@dataclass
class FunctionScan:
    found: list[Found] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    self_name: str = "self"
    method: cst.FunctionDef | None = None
    owner: str = ""  # the class the method belongs to
    #: containers whose calls an earlier run already wrapped (for the outermost trunk)
    rewritten: list[Container] = field(default_factory=list)


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


class _MethodScan:
    def __init__(
        self,
        module: cst.Module,
        table: ImportTable,
        containers: dict[str, Container],
        selector: Selector,
        function: cst.FunctionDef,
        self_name: str,
        qualname: str,
        target: str,
        functional: bool,
        root_path: tuple[cst.CSTNode, ...],
        checkpointers: dict[str, str] | None = None,
    ) -> None:
        self.module = module
        #: class name -> how that class checkpoints inside itself (`checkpointers.py`)
        self.checkpointers = checkpointers or {}
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
        self.result.self_name = self_name
        self.result.method = function
        self.self_name = self_name
        self.int_indexed: set[str] = set()
        # every loop over a module container, by id: (loop, the container it iterates)
        self.loops: dict[int, tuple[cst.For, Container]] = {}
        self.loops_reported: set[int] = set()  # loops with a wrapped or reported call
        # loops that reach a block container only through local names or unpacking
        # (x-transformers' `zip(*layer_variables)`): (loop, the containers it reaches)
        self.indirect: dict[int, tuple[cst.For, list[Container]]] = {}
        self._locals: dict[str, list[cst.BaseExpression]] | None = None
        self._ckpt_cache: dict[int, bool] = {}
        self.dry = False  # inside code annot already wrapped: only note the containers

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
            # a ModuleDict iterates its keys; a single module is not iterated
            return c if c.kind not in ("module", "dict") else None
        if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
            if isinstance(expr.slice[0].slice, cst.Slice):
                return self.pattern(expr.value)
            return None
        if isinstance(expr, cst.Call):
            func = expr.func
            args = [a.value for a in expr.args if a.keyword is None and not a.star]
            if isinstance(func, cst.Attribute) and not args:
                owner = self.container_of(func.value)
                if owner is not None and owner.kind == "dict":
                    if func.attr.value == "values":
                        return owner
                    if func.attr.value == "items":
                        return (None, owner)
                if owner is not None and owner.kind != "module" and func.attr.value == "children":
                    return owner
                return None
            name = dotted_name(func)
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
            parts: tuple[object, ...] = ()
            if isinstance(pattern, tuple) and len(pattern) == len(elements):
                parts = pattern
            elif isinstance(pattern, Container) and len(pattern.items) == len(elements):
                # `for attn, ff in self.layers` over ModuleList([Attention(), FeedForward()])
                parts = tuple(pattern.item(i) for i in range(len(elements)))
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
        return checkpoint_function(self.table, func)

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

    def block_of(self, expr: cst.BaseExpression) -> Container | None:
        """The container a callee or argument refers to a block of."""
        if isinstance(expr, cst.Attribute) and expr.attr.value in ("__call__", "forward"):
            expr = expr.value
        if isinstance(expr, cst.Name):
            return self.lookup(expr.value)[0]
        c = self.container_of(expr)
        if c is not None:
            return c
        if isinstance(expr, cst.Subscript):
            c = self.container_of(expr.value)
            if c is not None and c.kind != "module":
                return c
        return None

    def enclosing_loops(self) -> list[cst.For]:
        return [n for n in self.stack[self.base :] if isinstance(n, cst.For)]

    def skip(
        self, node: cst.CSTNode, block: cst.CSTNode, reason: str, *, unprotected: bool = False
    ) -> None:
        for loop in self.enclosing_loops():
            self.loops_reported.add(id(loop))
        unprotected = unprotected and self.selector.classes is not None
        self.result.skipped.append(
            Skipped(node, self.qualname, self.code(block), reason, unprotected)
        )

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
            original = node.orelse.body.body[0]  # type: ignore[union-attr]
            self.skip(node.test, original, "already rewritten by annot")
            # What the guard wraps still counts as checkpointed for the outermost trunk.
            self.dry = True
            self.stack += [node.orelse, node.orelse.body]  # type: ignore[union-attr,list-item]
            self.walk(original)
            del self.stack[-2:]
            self.dry = False
            return False
        if isinstance(node, cst.Name):
            self.result.names.add(node.value)
        elif isinstance(node, cst.Subscript):
            if isinstance(node.value, cst.Name) and _is_int_index(node):
                self.int_indexed.add(node.value.value)
        elif isinstance(node, cst.For):
            bound: dict[str, Container | None] = {}
            self.bind(node.target, self.pattern(node.iter), bound)
            for c in bound.values():
                if c is not None:
                    self.loops[id(node)] = (node, c)
                    break
            else:
                reached = self.containers_reached(node.iter)
                if reached and not self.dry and self.calls_what_it_binds(node, reached):
                    self.indirect[id(node)] = (node, reached)
        elif isinstance(node, cst.Call):
            self.visit_call(node)
        return True

    def visit_call(self, call: cst.Call) -> None:
        ckpt = self.known_checkpoint(call.func)
        if ckpt is not None:
            for arg in call.args:
                c = self.block_of(arg.value)
                if c is not None and self.selector.holds_blocks(c):
                    self.skip(call, arg.value, f"already checkpointed by {ckpt}")
                    return
            return
        if (dotted_name(call.func) or "").rpartition(".")[2] == "checkpoint":
            for arg in call.args:
                c = self.block_of(arg.value)
                if c is not None and self.selector.holds_blocks(c):
                    self.skip(
                        call,
                        arg.value,
                        f"passed to `{self.code(call.func)}`, which is not a known checkpoint function; left alone",
                    )
                    return
        func = call.func
        shape: str
        if isinstance(func, cst.Name):
            c, _ = self.lookup(func.value)
            if c is None or not self.selector.holds_blocks(c):
                return
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
        if self.dry:
            self.result.rewritten.append(c)
            return
        self.site(call, c, shape)

    def local_values(self) -> dict[str, list[cst.BaseExpression]]:
        """Every value assigned to each plain local name in the method."""
        if self._locals is None:
            values: dict[str, list[cst.BaseExpression]] = {}
            for n in _descendants(self.function):
                if isinstance(n, cst.Assign):
                    for t in n.targets:
                        if isinstance(t.target, cst.Name):
                            values.setdefault(t.target.value, []).append(n.value)
            self._locals = values
        return self._locals

    def calls_what_it_binds(self, loop: cst.For, reached: list[Container]) -> bool:
        """The body calls a name the loop binds (``block(x)``), or a name assigned in the
        body from one or from an element of ``reached`` (``layer = self.layers[i]``)."""
        paths = {f"{self.self_name}.{c.path}" for c in reached}
        bound = {n.value for n in _descendants(loop.target) if isinstance(n, cst.Name)}
        for n in _descendants(loop.body):
            if isinstance(n, cst.Assign) and any(
                (isinstance(m, cst.Name) and m.value in bound)
                or (isinstance(m, cst.Subscript) and dotted_name(m.value) in paths)
                for m in _descendants(n.value)
            ):
                bound |= {t.target.value for t in n.targets if isinstance(t.target, cst.Name)}
            elif isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in bound:
                return True
        return False

    def reaches_blocks(self, c: Container) -> bool:
        """``c`` holds blocks, or each of its elements holds one at some position (a
        ModuleList of ``ModuleList([norm, block])``, unpacked in the loop)."""
        return self.selector.holds_blocks(c) or any(
            self.selector.holds_blocks(c.item(i)) for i in range(len(c.items))
        )

    def containers_reached(self, expr: cst.BaseExpression) -> list[Container]:
        """Block containers ``expr`` reads, directly or through local names assigned from
        them (``layer_variables = (..., self.layers, ...)``)."""
        found: dict[str, Container] = {}
        seen: set[str] = set()
        todo: list[cst.CSTNode] = [expr]
        while todo:
            for n in _descendants(todo.pop()):
                if isinstance(n, cst.Attribute):
                    c = self.container_of(n)
                    if c is not None and c.kind != "module" and self.reaches_blocks(c):
                        found.setdefault(c.path, c)
                elif isinstance(n, cst.Name) and n.value not in seen:
                    seen.add(n.value)
                    todo.extend(self.local_values().get(n.value, ()))
        return list(found.values())

    def loop_times(self, loop: cst.For) -> str:
        """How many times ``loop`` runs, as code."""
        it = loop.iter
        c = self.container_of(it)
        if c is not None and c.kind != "module":
            return c.count or f"len({self.code(it)})"
        if isinstance(it, cst.Call) and dotted_name(it.func) == "range" and len(it.args) == 1:
            return self.code(it.args[0].value)
        if isinstance(it, cst.Call) and dotted_name(it.func) == "enumerate" and it.args:
            inner = it.args[0].value
            c = self.container_of(inner)
            if c is not None and c.kind != "module":
                return c.count or f"len({self.code(inner)})"
            return f"len({self.code(inner)})"
        return f"len({self.code(it)})"

    def times(self, c: Container, shape: str) -> str:
        factors = [self.loop_times(loop) for loop in self.enclosing_loops()]
        if shape == "sequential":
            factors.append(c.count or f"len({self.self_name}.{c.path})")
        if not factors:
            return "1"
        return " * ".join(f"({f})" if " " in f and len(factors) > 1 else f for f in factors)

    def cache_conditions(self, call: cst.Call) -> tuple[str, ...] | str:
        """Guard tests that keep a KV cache out of recomputation, or why there are none.

        A recomputation in backward runs the block again: a cache it updates would get
        every key twice (docs/design.md, pitfall 14). The call is checkpointed only when
        the cache is off at run time: ``use_cache`` false, every cache argument None.
        """
        tests: list[str] = []
        for arg in call.args:
            keyword = arg.keyword.value if arg.keyword is not None else None
            mentions = {n.value for n in _descendants(arg.value) if isinstance(n, cst.Name)}
            if keyword not in _REPLAYED_STATE and not mentions & _REPLAYED_STATE:
                continue
            if arg.star:
                return f"passes cache state through `{self.code(arg)}`; not wrapped"
            value = arg.value
            if isinstance(value, cst.Name) and value.value in ("None", "False"):
                continue
            if not _pure(value):
                return f"passes cache state as `{self.code(value)}`, which annot cannot test; not wrapped"
            code = self.code(value)
            code = f"({code})" if not isinstance(value, cst.Name | cst.Attribute) else code
            if keyword == "use_cache" or (keyword is None and mentions == {"use_cache"}):
                if isinstance(value, cst.Name) and value.value == "True":
                    return "passes use_cache=True: a recomputation would update the cache again; not wrapped"
                tests.append(f"not {code}")
            else:
                tests.append(f"{code} is None")
        return tuple(dict.fromkeys(tests))

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
                return self.skip(
                    call, call.func, f"inside {form}; opt in with --functional", unprotected=True
                )
            if isinstance(node, cst.SimpleStatementLine | cst.SimpleStatementSuite):
                stmt_depth = depth
                break
            if isinstance(node, cst.BaseCompoundStatement):
                return self.skip(
                    call,
                    call.func,
                    "in the header of a compound statement; not wrapped",
                    unprotected=True,
                )
        if stmt_depth is None:
            return
        if any(isinstance(n, cst.FunctionDef) for n in stack[self.base + 1 : stmt_depth]):
            return self.skip(
                call, call.func, "inside a nested function; not wrapped", unprotected=True
            )
        stmt = stack[stmt_depth]
        if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(
            stack[stmt_depth - 1], cst.IndentedBlock
        ):
            return self.skip(
                call,
                call.func,
                "on the same line as its `for`/`if`; put it on its own line to wrap it",
                unprotected=True,
            )
        if len(stmt.body) != 1:
            return self.skip(
                call,
                call.func,
                "shares its line with other statements (`;`); not wrapped",
                unprotected=True,
            )
        inside = self.checkpointed_inside(c)
        if inside is not None:
            return self.skip(call, call.func, inside)
        if self.selector.classes is None:  # marks and --blocks choose experts deliberately
            dispatch = expert_dispatch(call, stmt.body[0], c)
            if dispatch is not None:
                return self.skip(
                    call,
                    call.func,
                    f"an MoE expert dispatch ({dispatch}): checkpoint the layer holding the MoE, "
                    f"not each expert (--blocks {', '.join(c.classes) or 'NAME'} to wrap them anyway)",
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
        conditions = self.cache_conditions(call)
        if isinstance(conditions, str):
            return self.skip(call, call.func, conditions, unprotected=True)
        warning = None
        if conditions:
            warning = (
                "passes cache state: checkpointed only when "
                + " and ".join(conditions)
                + " at run time (a recomputation would update the cache again)"
            )
        for loop in self.enclosing_loops():
            self.loops_reported.add(id(loop))
        flag_on = None
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "use_cache":
                flag_on = flag_on_by_default(arg.value, self.function)
        found = Found(
            tuple(stack),
            stmt,
            call,
            shape,
            self.qualname,
            c,
            warning,
            conditions=conditions,
            times=self.times(c, shape),
            cache_flag_on=flag_on,
        )
        if shape != "sequential":
            parent = stack[-2]
            small = stmt.body[0]
            if isinstance(parent, cst.Subscript) and parent.value is call and _is_int_index(parent):
                found.hoist = self.target == "deepspeed"
            elif (
                self.target == "deepspeed"
                and isinstance(small, cst.Assign)
                and small.value is call
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)
            ):
                found.retuple_name = small.targets[0].target.value
        self.result.found.append(found)

    def checkpointed_inside(self, c: Container) -> str | None:
        """Why calls of ``c``'s elements are already checkpointed inside, or None."""
        if not c.classes or not all(name in self.checkpointers for name in c.classes):
            return None
        how = "; ".join(f"{name}: {self.checkpointers[name]}" for name in c.classes)
        return (
            f"already checkpointed inside its own class ({how}): wrapping the call too would "
            "recompute it a second time inside the first; switch that checkpointing on instead"
        )

    def finish(self) -> FunctionScan:
        """Say why each loop over a module container got nothing wrapped."""
        for key, (loop, c) in self.loops.items():
            if key in self.loops_reported:
                continue
            container = f"{self.self_name}.{c.path}"
            reason = self.selector.why_not(c)
            if reason is None:
                reason = "the loop does not call its element"
            self.result.skipped.append(
                Skipped(loop.target, self.qualname, f"loop over {container}", reason)
            )
        for key, (loop, reached) in self.indirect.items():
            if key in self.loops_reported:
                continue
            names = ", ".join(f"{self.self_name}.{c.path}" for c in reached)
            through = f"iterates {names} through `{self.code(loop.iter)}`"
            inside = [self.checkpointed_inside(c) for c in reached]
            experts = [e for c in reached if (e := holds_experts(c)) is not None]
            if all(inside):
                reason = f"{through}; {inside[0]}"
            elif experts and self.selector.classes is None:
                reason = (
                    f"{through}: an MoE expert dispatch ({experts[0]}): checkpoint the layer "
                    "holding the MoE, not each expert"
                )
            else:
                reason = (
                    f"{through}, which annot cannot follow to the block each step calls: "
                    "neither wrapped nor proven safe to wrap; loop over the container itself "
                    "(`for block in ...:`) to have it wrapped, or checkpoint at run time "
                    "(annot.auto_wrap)"
                )
            self.result.skipped.append(
                Skipped(
                    loop.target,
                    self.qualname,
                    f"loop over {names}",
                    reason,
                    unprotected=self.selector.classes is not None and not all(inside),
                )
            )
        for f in self.result.found:
            if f.retuple_name is not None and f.retuple_name not in self.int_indexed:
                f.retuple_name = None
        return self.result


def _pure(node: cst.BaseExpression) -> bool:
    """An expression that can be evaluated twice with the same result (names, attributes,
    constants, comparisons, ``a if c else b``): safe to repeat in the guard."""
    allowed = (
        cst.Name,
        cst.Attribute,
        cst.Integer,
        cst.SimpleString,
        cst.Comparison,
        cst.ComparisonTarget,
        cst.BooleanOperation,
        cst.UnaryOperation,
        cst.IfExp,
        cst.BaseBooleanOp,
        cst.BaseCompOp,
        cst.BaseUnaryOp,
    )
    return all(isinstance(n, allowed) for n in _descendants(node))


def _descendants(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for child in child_nodes(node):
        yield from _descendants(child)


def _class_contents(containers: dict[str, Container]) -> set[str]:
    """Every class a module class holds, by name (list elements and unpacked items too)."""
    out: set[str] = set()
    for c in containers.values():
        out.update(c.classes)
        for item in c.items:
            out.update(item)
    return out


def _outermost(scans: list[FunctionScan], holds: dict[str, set[str]]) -> None:
    """Trunk mode: drop sites inside classes whose instances are themselves checkpointed
    (litgpt's MoE experts inside a checkpointed block would run three times)."""
    while True:
        todo: list[tuple[str, str]] = []  # (class checkpointed whole, the class calling it)
        for scan in scans:
            for c in [f.container for f in scan.found] + scan.rewritten:
                todo.extend((cls, scan.owner) for cls in c.classes)
                todo.extend((cls, scan.owner) for item in c.items for cls in item)
        inner: dict[str, str] = {}  # class -> the class whose trunk holds it
        while todo:
            cls, outer = todo.pop()
            if cls in inner:
                continue
            inner[cls] = outer
            todo.extend((c, outer) for c in holds.get(cls, ()))
        moved = False
        for scan in scans:
            keep = []
            for f in scan.found:
                if f.owner in inner and inner[f.owner] != f.owner:
                    outer = inner[f.owner]
                    scan.skipped.append(
                        Skipped(
                            f.call,
                            f.function,
                            scan_code(f),
                            f"inside {f.owner}, which is checkpointed whole from {outer}'s "
                            f"trunk (the outermost trunk wins; --blocks {f.owner} or marks to choose)",
                        )
                    )
                    moved = True
                else:
                    keep.append(f)
            scan.found = keep
        if not moved:
            return


def scan_code(f: Found) -> str:
    module = f.path[0]
    assert isinstance(module, cst.Module)
    return module.code_for_node(f.call.func)


def scan_module(
    module: cst.Module,
    table: ImportTable,
    selector: Selector,
    *,
    target: str,
    functional: bool = False,
) -> tuple[list[FunctionScan], list[Container]]:
    """Scan every method (but ``__init__``) of every class at module level or nested in
    classes; classes without a module container are skipped."""
    scans: list[FunctionScan] = []
    holds: dict[str, set[str]] = {}
    checkpointers = {
        cls.name.value: how
        for cls in _descendants(module)
        if isinstance(cls, cst.ClassDef)
        and (how := self_checkpointing(module, table, cls)) is not None
    }

    def visit_class(cls: cst.ClassDef, path: tuple[cst.CSTNode, ...], prefix: str) -> None:
        body = cls.body
        if not isinstance(body, cst.IndentedBlock):
            return
        inner_path = (*path, cls, body)
        for s in body.body:
            if isinstance(s, cst.ClassDef):
                visit_class(s, inner_path, f"{prefix}{cls.name.value}.")
        methods = [s for s in body.body if isinstance(s, cst.FunctionDef)]
        containers = read_containers(module, table, methods)
        if not containers:
            return
        holds.setdefault(cls.name.value, set()).update(_class_contents(containers))
        for method in methods:
            self_name = first_param(method)
            if method.name.value == "__init__" or self_name is None:
                continue
            scan = _MethodScan(
                module,
                table,
                containers,
                selector,
                method,
                self_name,
                f"{prefix}{cls.name.value}.{method.name.value}",
                target,
                functional,
                inner_path,
                checkpointers,
            )
            scan.walk(method)
            result = scan.finish()
            result.owner = cls.name.value
            for f in result.found:
                f.owner = cls.name.value
            scans.append(result)

    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            visit_class(stmt, (module,), "")
    if selector.classes is None:
        _outermost(scans, holds)
    chosen = list({id(f.container): f.container for s in scans for f in s.found}.values())
    return scans, chosen
