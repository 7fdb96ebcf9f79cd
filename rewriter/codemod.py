"""Source -> source: wrap block calls in activation checkpointing, or undo exactly that.

A wrapped statement becomes

    if self.training and torch.is_grad_enabled():  # annot: checkpoint
        x = deepspeed.checkpointing.checkpoint(block, x)
    else:
        x = block(x)

The ``else`` branch is the original statement, byte for byte, so eval and ``no_grad`` run
the block directly (no recomputation) and ``--undo`` only has to put that branch back.
The marker comment also makes a second run a no-op. A call passing a KV cache gets the
cache tests in its guard (``and not use_cache``, ``and past_key_values is None``): it is
checkpointed only when no cache is updated (docs/design.md, pitfall 14).
Nothing else in the file changes except import lines ending in ``# annot: import``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import libcst as cst

from annot.rewriter._parse import parse_module
from annot.rewriter._positions import generate, locate
from annot.rewriter.imports import ImportTable, import_marker
from annot.rewriter.sites import (
    GUARD_MARKER,
    Container,
    Found,
    FunctionScan,
    Selector,
    is_annot_guard,
    scan_module,
)
from annot.rewriter.streams import candidates, safe_streams

__all__ = [
    "RewriteResult",
    "Site",
    "SkippedSite",
    "rewrite_module",
    "rewrite_source",
    "undo_source",
]

TARGETS = ("deepspeed", "torch")
# DeepSpeed's non-reentrant variant: its reentrant `checkpoint` gives a block whose tensor
# inputs need no grad no parameter gradients at all (docs/design.md, pitfalls 9 and 13).
_CHECKPOINT = {
    "deepspeed": "deepspeed.checkpointing.non_reentrant_checkpoint",
    "torch": "torch.utils.checkpoint.checkpoint",
}
_BOM = "\ufeff"
# What the emitted code refers to -> (module to import, the name that import binds, the
# alias used when that name means something else in the file, submodule that attribute
# access needs: `import torch` alone does not load torch.utils.checkpoint).
_SOURCES = {
    "deepspeed.checkpointing.non_reentrant_checkpoint": (
        "deepspeed",
        "deepspeed",
        "annot_deepspeed",
        None,
    ),
    "torch.utils.checkpoint.checkpoint": (
        "torch.utils.checkpoint",
        "torch",
        "annot_checkpoint",
        "torch.utils.checkpoint",
    ),
    "torch.is_grad_enabled": ("torch", "torch", "annot_torch", None),
    "functools.partial": ("functools", "functools", "annot_functools", None),
}


@dataclass(frozen=True)
class Site:
    """A wrapped call: where, in which ``forward``, and the callee as written."""

    line: int
    column: int
    function: str
    block: str
    container: str
    shape: str
    warning: str | None = None
    #: the guard tests a ``use_cache`` flag that is on unless the caller turns it off,
    #: and why (then a training run keeping the default checkpoints nothing here)
    cache_flag_on: str | None = None


@dataclass(frozen=True)
class SkippedSite:
    """A block call (or loop) left alone, and why. ``unprotected``: a marked or
    ``--blocks`` class is called here and runs without checkpointing."""

    line: int
    column: int
    function: str
    block: str
    reason: str
    unprotected: bool = False


@dataclass(frozen=True)
class RewriteResult:
    """``code`` is the new source (== the input when nothing changed)."""

    code: str
    wrapped: tuple[Site, ...] = ()
    skipped: tuple[SkippedSite, ...] = ()
    #: containers chosen as holding blocks, as ``Class.forward: self.h (Block x count)``
    chosen: tuple[str, ...] = ()
    imports_added: tuple[str, ...] = ()
    changed: bool = False
    #: per method with wrapped calls: ``Class.method: n_layer + 2`` (checkpoint calls one
    #: run of that method makes, as written in the source)
    calls_per_forward: tuple[str, ...] = field(default=())


# -- emitted code -----------------------------------------------------------------------------


class _Emitter:
    """Names the emitted code uses, resolved through (or added to) the module's imports."""

    def __init__(self, module: cst.Module, table: ImportTable, target: str) -> None:
        self.module = module
        self.table = table
        self.target = target
        self.added: list[str] = []
        self.newline = module.default_newline
        self.indent = module.default_indent
        self._refs: dict[str, str] = {}

    def _import(self, module_name: str, preferred: str, alias: str) -> None:
        """Add ``import module_name`` (or ``as alias`` when ``preferred`` is taken)."""
        line = f"import {module_name}"
        if self.table.is_bound(preferred) and self.table.names.get(preferred) != preferred:
            line += f" as {alias}"
        node = cst.parse_statement(line + "\n")
        assert isinstance(node, cst.SimpleStatementLine)
        self.table.add_import(node.body[0])  # type: ignore[arg-type]
        self.added.append(line)

    def ref(self, qualified: str) -> str:
        """Code reaching ``qualified`` (one of `_SOURCES`), importing it if needed."""
        if qualified not in self._refs:
            module_name, binds, alias, needs = _SOURCES[qualified]
            code = self.table.reference(qualified, needs_module=needs)
            if code is None:
                self._import(module_name, binds, alias)
                code = self.table.reference(qualified)
            assert code is not None, qualified
            self._refs[qualified] = code
        return self._refs[qualified]

    def parse(self, code: str) -> cst.BaseStatement:
        """Parse emitted code written with 4 spaces and ``\\n`` in the module's own style."""
        lines = code.rstrip("\n").split("\n")
        text = self.newline.join(
            self.indent * ((len(s) - len(s.lstrip(" "))) // 4) + s.lstrip(" ") for s in lines
        )
        return cst.parse_statement(text + self.newline, config=self.module.config_for_parsing)

    def expr(self, code: str) -> cst.BaseExpression:
        return cst.parse_expression(code, config=self.module.config_for_parsing)


def _sep(call: cst.Call) -> cst.BaseParenthesizableWhitespace:
    """Whitespace between arguments: a new line and indent in a one-per-line call."""
    ws = call.whitespace_before_args
    return ws if isinstance(ws, cst.ParenthesizedWhitespace) else cst.SimpleWhitespace(" ")


def _prepend_arg(call: cst.Call, func: cst.BaseExpression, value: cst.BaseExpression) -> cst.Call:
    first = (
        cst.Arg(value, comma=cst.Comma(whitespace_after=_sep(call)))
        if call.args
        else cst.Arg(value)
    )
    return call.with_changes(func=func, args=(first, *call.args))


def _append_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    if not call.args:
        return call.with_changes(args=(arg,))
    last = call.args[-1]
    if isinstance(last.comma, cst.Comma):  # keep the trailing comma, now after the new arg
        new_last = last.with_changes(comma=cst.Comma(whitespace_after=_sep(call)))
        arg = arg.with_changes(comma=last.comma)
    else:
        new_last = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(args=(*call.args[:-1], new_last, arg))


_NO_SPACE = cst.AssignEqual(
    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
)


def checkpoint_call(
    call: cst.Call, em: _Emitter, streams: list[str], fresh: Callable[[str], str]
) -> cst.Call:
    """``block(a, k=v)`` -> the checkpointed call, keeping the argument layout.

    torch: ``checkpoint(block, a, use_reentrant=False)``; with keyword arguments
    ``checkpoint(functools.partial(block, a, k=v), use_reentrant=False)``, because torch's
    checkpoint would swallow keywords named like its own options (``use_reentrant``,
    ``preserve_rng_state``, ``context_fn``, ``debug``, ...). A partial binds the block
    object now; a lambda would see the loop variable's later value in backward.
    Non-reentrant checkpointing tracks tensors the partial holds, so gradients flow.

    deepspeed: ``non_reentrant_checkpoint(block, x)`` when every argument is a stream
    (`annot.rewriter.streams`), else ``non_reentrant_checkpoint(lambda x, block=block,
    mask=mask: block(x, mask), x)``: only the streams go to DeepSpeed (which may empty
    them in place); the block and every other argument are evaluated now, as in the
    original call, and bound as the lambda's defaults.
    """
    if em.target == "deepspeed":
        func = em.expr(em.ref(_CHECKPOINT["deepspeed"]))
        # Streams are distinct positional name arguments (`streams.candidates`): as many
        # as the call has arguments means every argument is one.
        if len(streams) == len(call.args):
            return _prepend_arg(call, func, call.func)
        return _bound_call(call, func, streams, fresh)
    ckpt = em.expr(em.ref(_CHECKPOINT["torch"]))
    flag = cst.Arg(cst.Name("False"), keyword=cst.Name("use_reentrant"), equal=_NO_SPACE)
    if any(a.keyword is not None or a.star == "**" for a in call.args):
        partial = _prepend_arg(call, em.expr(em.ref("functools.partial")), call.func)
        return cst.Call(
            ckpt,
            args=(
                cst.Arg(partial, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                flag,
            ),
        )
    return _append_arg(_prepend_arg(call, ckpt, call.func), flag)


_CONSTANTS = {"None", "True", "False"}


def _bound_call(
    call: cst.Call, ckpt: cst.BaseExpression, streams: list[str], fresh: Callable[[str], str]
) -> cst.Call:
    """``ckpt(lambda <streams>, <name>=<value>...: <call on those names>, <streams>)``."""
    defaults: dict[str, cst.BaseExpression] = {}

    def bind(value: cst.BaseExpression, base: str) -> cst.BaseExpression:
        if isinstance(value, cst.Name):
            if value.value in _CONSTANTS or value.value in streams:
                return value
            defaults.setdefault(value.value, value)
            return value
        if isinstance(value, cst.Integer | cst.Float | cst.SimpleString):
            return value
        name = fresh(base)
        defaults[name] = value
        return cst.Name(name)

    func = bind(call.func, "_block")
    args = [
        a.with_changes(value=bind(a.value, f"_arg{i}")) for i, a in enumerate(call.args)
    ]
    body = call.with_changes(func=func, args=args)
    params = [cst.Param(cst.Name(s)) for s in streams] + [
        cst.Param(cst.Name(n), default=v, equal=_NO_SPACE) for n, v in defaults.items()
    ]
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    params = [p.with_changes(comma=comma) for p in params[:-1]] + params[-1:]
    lam = cst.Lambda(params=cst.Parameters(params=params), body=body)
    if not params:
        lam = lam.with_changes(whitespace_after_lambda=cst.SimpleWhitespace(""))
    out = [cst.Arg(lam)] + [cst.Arg(cst.Name(s)) for s in streams]
    out = [a.with_changes(comma=comma) for a in out[:-1]] + out[-1:]
    return cst.Call(ckpt, args=out)


def _replace(
    root: cst.CSTNode,
    funcs: dict[int, Callable[[cst.CSTNode], cst.CSTNode]],
    paths: Iterable[Iterable[cst.CSTNode]],
) -> cst.CSTNode:
    """Rebuild ``root``, applying ``funcs[id(node)]`` to each listed node after its children.

    Only the ancestors on ``paths`` are rebuilt (cheaper than a transformer over the whole
    tree); bottom-up order makes nested sites (``f(g(x))``, both blocks) compose.
    """
    dirty = {id(n) for path in paths for n in path}

    def rebuild(node: cst.CSTNode) -> cst.CSTNode:
        key = id(node)
        if key not in dirty:
            return node
        changes: dict[str, object] = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, cst.CSTNode):
                new = rebuild(value)
                if new is not value:
                    changes[f.name] = new
            elif isinstance(value, tuple | list) and value and isinstance(value[0], cst.CSTNode):
                items = [rebuild(v) for v in value]
                if any(a is not b for a, b in zip(items, value, strict=True)):
                    changes[f.name] = type(value)(items)
        new_node = node.with_changes(**changes) if changes else node
        return funcs[key](new_node) if key in funcs else new_node

    return rebuild(root)


def _wrapped_statement(
    stmt: cst.SimpleStatementLine,
    found: list[Found],
    em: _Emitter,
    scan_names: set[str],
    self_name: str,
    streams: dict[int, list[str]],
) -> cst.If:
    """The ``if guard: <checkpointed> else: <original>`` replacing one statement."""
    taken = set(scan_names)

    def fresh(base: str) -> str:
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        return name

    # The checkpoint import first: `import torch.utils.checkpoint` also binds `torch`.
    em.ref(_CHECKPOINT[em.target])
    torch = em.ref("torch.is_grad_enabled").rpartition(".")[0]
    tests = [f"{self_name}.training", f"{torch}.is_grad_enabled()"]
    tests += dict.fromkeys(t for f in found for t in f.conditions)
    guard = em.expr(" and ".join(tests))
    before: list[cst.BaseStatement] = []
    after: list[cst.BaseStatement] = []
    funcs: dict[int, Callable[[cst.CSTNode], cst.CSTNode]] = {}
    keep_statement = True

    def wrap(f: Found) -> Callable[[cst.CSTNode], cst.CSTNode]:
        def apply(call: cst.CSTNode) -> cst.CSTNode:
            nonlocal keep_statement
            assert isinstance(call, cst.Call)
            if f.shape == "sequential":
                stmts, replacement = _sequential(f, call, em, fresh, streams.get(id(f.call), []))
                before.extend(stmts)
                if replacement is None:
                    keep_statement = False
                    return call
                return replacement
            new_call = checkpoint_call(call, em, streams.get(id(f.call), []), fresh)
            if f.hoist:  # `block(x)[0]`: index a re-tupled result
                tmp = fresh("outputs")
                target = cst.AssignTarget(cst.Name(tmp))
                before.append(cst.SimpleStatementLine([cst.Assign([target], new_call)]))
                before.append(_retuple(tmp, torch, em))
                return cst.Name(tmp)
            if f.retuple_name is not None:
                after.append(_retuple(f.retuple_name, torch, em))
            return new_call

        return apply

    for f in found:
        funcs[id(f.call)] = wrap(f)
    start = next(i for i, n in enumerate(found[0].path) if n is stmt)
    new_stmt = _replace(stmt, funcs, [f.path[start:] for f in found])
    assert isinstance(new_stmt, cst.SimpleStatementLine)  # only calls inside it were replaced
    body: list[cst.BaseStatement] = [*before]
    if keep_statement:
        body.append(new_stmt.with_changes(leading_lines=()))
    body += after
    header = cst.TrailingWhitespace(
        whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(GUARD_MARKER)
    )
    return cst.If(
        test=guard,
        body=cst.IndentedBlock(body=body, header=header),
        orelse=cst.Else(body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=())])),
        leading_lines=stmt.leading_lines,
    )


def _retuple(name: str, torch: str, em: _Emitter) -> cst.BaseStatement:
    return em.parse(
        f"if isinstance({name}, {torch}.Tensor):  # deepspeed returns a 1-tuple's element bare\n"
        f"    {name} = ({name},)\n"
    )


def _sequential(
    f: Found,
    call: cst.Call,
    em: _Emitter,
    fresh: Callable[[str], str],
    streams: list[str],
) -> tuple[list[cst.BaseStatement], cst.Name | None]:
    """``x = self.blocks(x)`` on a Sequential: checkpoint each element in a loop.

    Iterating the same Sequential keeps ``state_dict`` keys unchanged. Returns the
    statements to run first and what replaces the call in the original statement
    (None: the loop already assigned the statement's target, drop the statement).
    """
    module = em.module
    small = f.statement.body[0]
    seq = module.code_for_node(f.call.func)
    arg = module.code_for_node(call.args[0].value) if call.args else None
    block = fresh("block")
    if em.target == "torch":
        ckpt = em.ref(_CHECKPOINT["torch"]) + "({blk}, {h}, use_reentrant=False)"
    elif streams:
        ckpt = em.ref(_CHECKPOINT["deepspeed"]) + "({blk}, {h})"
    else:  # the input may have a second holder: DeepSpeed must not empty it
        ckpt = em.ref(_CHECKPOINT["deepspeed"]) + "(lambda {blk}={blk}, {h}={h}: {blk}({h}))"
    out: list[cst.BaseStatement] = []
    if (
        isinstance(small, cst.Assign)
        and small.value is f.call
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
    ):
        h = small.targets[0].target.value
        replacement = None
    else:
        h = fresh("hidden")
        replacement = cst.Name(h)
    if arg != h:
        out.append(em.parse(f"{h} = {arg}\n"))
    out.append(em.parse(f"for {block} in {seq}:\n    {h} = {ckpt.format(blk=block, h=h)}\n"))
    return out, replacement


# -- whole module --------------------------------------------------------------------------------


def _insert_imports(
    module: cst.Module, lines: list[str]
) -> tuple[cst.Module, list[cst.BaseStatement]]:
    """Add import lines (marked) after the last module-level import, or the docstring."""
    if not lines:
        return module, []
    index = 0
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
            stmt.body[0], cst.Import | cst.ImportFrom
        ):
            index = i + 1
    if index == 0 and module.body:
        first = module.body[0]
        if (
            isinstance(first, cst.SimpleStatementLine)
            and isinstance(first.body[0], cst.Expr)
            and isinstance(first.body[0].value, cst.SimpleString | cst.ConcatenatedString)
        ):
            index = 1
    nl = module.default_newline
    new: list[cst.BaseStatement] = [
        cst.parse_statement(f"{line}  {import_marker}{nl}", config=module.config_for_parsing)
        for line in lines
    ]
    return module.with_changes(body=(*module.body[:index], *new, *module.body[index:])), new


def rewrite_module(
    module: cst.Module,
    *,
    target: str = "deepspeed",
    blocks: Iterable[str] | None = None,
    functional: bool = False,
) -> tuple[cst.Module, RewriteResult]:
    """Rewrite a parsed module; see `rewrite_source`. ``result.code`` is "" when unchanged."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    table = ImportTable.of(module)
    selector = Selector(frozenset(blocks) if blocks is not None else None)
    scans, chosen = scan_module(module, table, selector, target=target, functional=functional)
    found = [f for s in scans for f in s.found]
    skipped = [k for s in scans for k in s.skipped]
    if not found and not skipped:
        return module, RewriteResult(code="")
    em = _Emitter(module, table, target)
    repl: dict[int, Callable[[cst.CSTNode], cst.CSTNode]] = {}
    paths = []
    guards: dict[int, int] = {}  # id(guard test) -> id(original statement in its else)
    for scan in scans:
        by_stmt: dict[int, list[Found]] = {}
        for f in scan.found:
            by_stmt.setdefault(id(f.statement), []).append(f)
        streams = _streams(scan) if target == "deepspeed" else {}
        for group in by_stmt.values():
            stmt = group[0].statement
            new = _wrapped_statement(stmt, group, em, scan.names, scan.self_name, streams)
            guards[id(new.test)] = id(new.orelse.body.body[0])  # type: ignore[union-attr]

            def replacement(_node: cst.CSTNode, new: cst.CSTNode = new) -> cst.CSTNode:
                return new

            repl[id(stmt)] = replacement
            path = group[0].path
            paths.append(path[: next(i for i, n in enumerate(path) if n is stmt) + 1])
    wanted = [f.call for f in found] + [k.node for k in skipped]
    code = ""
    if repl:
        new_module = _replace(module, repl, paths)
        assert isinstance(new_module, cst.Module)
        new_module, new_imports = _insert_imports(new_module, em.added)
        # One codegen gives the new code and where the wanted nodes were in the old one.
        code, positions = generate(new_module, wanted, new_imports, guards)
        if len(positions) != len({id(n) for n in wanted}):  # pragma: no cover - defensive
            positions = locate(module, wanted)
    else:
        new_module, positions = module, locate(module, wanted)

    def where(node: cst.CSTNode) -> tuple[int, int]:
        return positions[id(node)]

    sites = sorted(
        (
            Site(
                *where(f.call),
                f.function,
                module.code_for_node(f.call.func),
                "self." + f.container.path,
                f.shape,
                f.warning,
                f.cache_flag_on,
            )
            for f in found
        ),
        key=lambda s: (s.line, s.column),
    )
    skips = sorted(
        (
            SkippedSite(*where(k.node), k.function, k.block, k.reason, k.unprotected)
            for k in skipped
        ),
        key=lambda s: (s.line, s.column),
    )
    return new_module, RewriteResult(
        code=code,
        wrapped=tuple(sites),
        skipped=tuple(skips),
        chosen=tuple(_describe(c) for c in dict.fromkeys(chosen)),
        imports_added=tuple(em.added),
        changed=bool(repl),
        calls_per_forward=tuple(_calls(s) for s in scans if s.found),
    )


def _describe(c: Container) -> str:
    classes = ", ".join(c.classes) or "?"
    count = f" x {c.count}" if c.count else ""
    return f"self.{c.path}: {c.kind} of {classes}{count}"


def _calls(scan: FunctionScan) -> str:
    """``Class.method: n_layer + 1``: checkpoint calls one run of the method makes."""
    counts = [f.times for f in scan.found]
    ones = counts.count("1")
    terms = [c for c in counts if c != "1"] + ([str(ones)] if ones else [])
    return f"{scan.found[0].function}: {' + '.join(terms)}"


def _streams(scan: FunctionScan) -> dict[int, list[str]]:
    """id(call) -> the names DeepSpeed may be handed and empty (`rewriter.streams`)."""
    method = scan.method
    if method is None or not isinstance(method.body, cst.IndentedBlock):
        return {}
    tops = {id(s): s for s in method.body.body}
    sites = []
    for f in scan.found:
        top = next(n for n in f.path if id(n) in tops)
        loops = [n for n in f.path[f.path.index(method) :] if isinstance(n, cst.For)]
        assert isinstance(top, cst.BaseStatement)
        sites.append((f, top, candidates(f.call, f.statement, loops)))
    safe = safe_streams(method, [(top, args) for _, top, args in sites])
    return {
        id(f.call): [
            a.value.value  # type: ignore[attr-defined]
            for a in args
            if (a.value.value, id(top)) in safe  # type: ignore[attr-defined]
        ]
        for f, top, args in sites
    }


def _split_bom(source: str) -> tuple[str, str]:
    return (_BOM, source[1:]) if source.startswith(_BOM) else ("", source)


def rewrite_source(
    source: str,
    *,
    target: str = "deepspeed",
    blocks: Iterable[str] | None = None,
    functional: bool = False,
) -> RewriteResult:
    """Wrap the block calls in ``source``'s ``forward`` methods in activation checkpointing.

    ``blocks``: class names whose calls to wrap (the marked classes of a run, or
    ``--blocks``); None picks the trunk. ``target``: ``"deepspeed"`` or ``"torch"``.
    ``functional`` also wraps calls inside comprehensions and ``functools.reduce`` lambdas.
    Raises ``libcst.ParserSyntaxError`` on source that does not parse.
    Every byte outside the wrapped statements and the added imports is kept.
    """
    bom, text = _split_bom(source)
    module = parse_module(text)
    new_module, result = rewrite_module(module, target=target, blocks=blocks, functional=functional)
    code = bom + result.code if result.changed else source
    return dataclasses.replace(result, code=code)


class _Undo(cst.CSTTransformer):
    def __init__(self) -> None:
        self.removed = 0

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.BaseStatement:
        if not is_annot_guard(original_node):
            return updated_node
        self.removed += 1
        original = original_node.orelse.body.body[0]  # type: ignore[union-attr]
        assert isinstance(original, cst.BaseStatement)  # an IndentedBlock's (is_annot_guard)
        return original.with_changes(leading_lines=original_node.leading_lines)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        comment = original_node.trailing_whitespace.comment
        if comment is not None and comment.value == import_marker:
            self.removed += 1
            return cst.RemoveFromParent()
        return updated_node


def undo_source(source: str) -> RewriteResult:
    """Remove what `rewrite_source` inserted: guards (restoring the original statements)
    and the import lines it added. ``changed`` is False when there was nothing to undo."""
    if "# annot:" not in source:
        return RewriteResult(code=source)
    bom, text = _split_bom(source)
    undo = _Undo()
    module = parse_module(text).visit(undo)
    if not undo.removed:
        return RewriteResult(code=source)
    return RewriteResult(code=bom + module.code, changed=True)
