"""Which arguments of a wrapped call DeepSpeed may empty in place.

With ``partition_activations`` or ``cpu_checkpointing`` DeepSpeed's checkpoint replaces
the storage of every floating-point tensor argument after the forward and puts a flat copy
back only in backward (docs/design.md, pitfall 13). That is right only for a tensor no
other code holds: the per-block activation stream, ``x = block(x, ...)``. A name is
handed to DeepSpeed as such a *stream* only when the source shows no second holder:

- it is a positional argument, once, and the statement (or the loop around it)
  assigns it again;
- a plain ``name = ...`` at the top level of the method gives it a fresh value before
  the top-level statement holding the call (never a parameter: the caller may hold that
  tensor);
- from that assignment to the end of that statement, the name is read nowhere else
  (``hiddens.append(x)``, ``x = block(x) + x`` and ``h = x`` all keep a second holder).

Everything else (rotary tables, masks, conditioning, the stream where the rule does
not hold) is bound to the function DeepSpeed recomputes, never passed to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from annot.rewriter.containers import child_nodes

__all__ = ["assigned_names", "safe_streams"]


def assigned_names(target: cst.BaseExpression) -> Iterator[str]:
    """Names a plain assignment target binds (``x``, ``x, aux``, ``*rest``)."""
    if isinstance(target, cst.Name):
        yield target.value
    elif isinstance(target, cst.Tuple | cst.List):
        for el in target.elements:
            yield from assigned_names(el.value)
    elif isinstance(target, cst.StarredElement):
        yield from assigned_names(target.value)


def _statement_assigns(stmt: cst.BaseStatement) -> set[str]:
    out: set[str] = set()
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                for t in small.targets:
                    out.update(assigned_names(t.target))
            elif isinstance(small, cst.AnnAssign) and small.value is not None:
                out.update(assigned_names(small.target))
    return out


def _loop_assigns(loop: cst.For) -> set[str]:
    """Names plain assignments inside ``loop``'s body bind (not in nested defs)."""
    out: set[str] = set()
    todo: list[cst.CSTNode] = [loop.body]
    while todo:
        node = todo.pop()
        if isinstance(node, cst.FunctionDef | cst.ClassDef | cst.Lambda):
            continue
        if isinstance(node, cst.SimpleStatementLine):
            out |= _statement_assigns(node)
            continue
        todo.extend(child_nodes(node))
    return out


def _loads(node: cst.CSTNode, name: str, skip: set[int]) -> bool:
    """True when ``name`` is read anywhere in ``node`` (nodes in ``skip`` aside)."""
    if id(node) in skip:
        return False
    if isinstance(node, cst.Name):
        return node.value == name
    if isinstance(node, cst.Attribute):
        return _loads(node.value, name, skip)
    if isinstance(node, cst.Arg):
        return _loads(node.value, name, skip)
    if isinstance(node, cst.Param):
        return any(_loads(n, name, skip) for n in (node.default, node.annotation) if n is not None)
    if isinstance(node, cst.Assign):
        return _loads(node.value, name, skip) or any(
            _store_loads(t.target, name, skip) for t in node.targets
        )
    if isinstance(node, cst.AnnAssign):
        return (node.value is not None and _loads(node.value, name, skip)) or _store_loads(
            node.target, name, skip
        )
    if isinstance(node, cst.For):
        return (
            _store_loads(node.target, name, skip)
            or _loads(node.iter, name, skip)
            or _loads(node.body, name, skip)
            or (node.orelse is not None and _loads(node.orelse, name, skip))
        )
    if isinstance(node, cst.CompFor):
        return (
            _store_loads(node.target, name, skip)
            or _loads(node.iter, name, skip)
            or any(_loads(i, name, skip) for i in node.ifs)
            or (node.inner_for_in is not None and _loads(node.inner_for_in, name, skip))
        )
    if isinstance(node, cst.NamedExpr):
        return _loads(node.value, name, skip)
    return any(_loads(child, name, skip) for child in child_nodes(node))


def _store_loads(target: cst.BaseExpression, name: str, skip: set[int]) -> bool:
    """Reads inside an assignment target (``self.x[i] = ...`` reads ``self`` and ``i``)."""
    if isinstance(target, cst.Name):
        return False
    if isinstance(target, cst.Tuple | cst.List):
        return any(_store_loads(el.value, name, skip) for el in target.elements)
    if isinstance(target, cst.StarredElement):
        return _store_loads(target.value, name, skip)
    return _loads(target, name, skip)


def candidates(call: cst.Call, stmt: cst.SimpleStatementLine, loops: Iterable[cst.For]) -> list[cst.Arg]:
    """Positional name arguments the statement or its innermost loop assigns again."""
    assigned = _statement_assigns(stmt)
    innermost = list(loops)[-1:]
    for loop in innermost:
        assigned |= _loop_assigns(loop)
    names = [a.value.value for a in call.args if isinstance(a.value, cst.Name)]
    return [
        a
        for a in call.args
        if a.keyword is None
        and not a.star
        and isinstance(a.value, cst.Name)
        and a.value.value in assigned
        and names.count(a.value.value) == 1
    ]


def safe_streams(
    function: cst.FunctionDef,
    sites: list[tuple[cst.BaseStatement, list[cst.Arg]]],
) -> set[tuple[str, int]]:
    """(name, id of the top-level statement) pairs among the sites' candidates that
    DeepSpeed may empty (module docstring).

    ``sites``: (top-level statement of ``function`` holding the call, its candidates).
    """
    body = function.body
    if not isinstance(body, cst.IndentedBlock):
        return set()
    passed = {id(a.value) for _, args in sites for a in args}
    index = {id(stmt): i for i, stmt in enumerate(body.body)}
    assigns = [_statement_assigns(stmt) for stmt in body.body]
    safe = set()
    for top, args in sites:
        end = index[id(top)]
        for a in args:
            assert isinstance(a.value, cst.Name)
            name = a.value.value
            fresh = [i for i in range(end) if name in assigns[i]]
            if not fresh:
                continue  # a parameter, or set only inside a branch: the caller may hold it
            if not any(_loads(body.body[i], name, passed) for i in range(fresh[-1] + 1, end + 1)):
                safe.add((name, id(top)))
    return safe
