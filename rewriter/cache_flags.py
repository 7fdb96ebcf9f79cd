"""Is the cache flag a wrapped call's guard tests on by default?

A wrapped call that passes ``use_cache`` is checkpointed only while the flag is off
(docs/design.md, pitfall 14): a recomputation would update a live cache again. Where
the flag is on unless the caller turns it off (transformers' configs set
``use_cache=True``), a training run that does not pass ``use_cache=False`` keeps the
guard's other branch every step and checkpoints nothing, with no error. The rewriter
cannot change that without changing the numbers; it tells the user.
"""

from __future__ import annotations

import libcst as cst

from annot.rewriter.imports import dotted_name

__all__ = ["flag_on_by_default"]

# transformers 5 fills a forward's None arguments from the config with this decorator.
_CONFIG_DEFAULTS_DECORATOR = "merge_with_config_defaults"


def flag_on_by_default(flag: cst.BaseExpression, method: cst.FunctionDef) -> str | None:
    """Why ``flag`` (the ``use_cache`` value passed in ``method``) is on unless the
    caller turns it off, for the report; None when nothing in the source says so."""
    name = dotted_name(flag)
    if name is None:
        return None
    if name.endswith("config.use_cache"):
        return f"`{name}` is the config's, and transformers' configs set use_cache=True"
    if "." in name:
        return None
    default = _default_of(method, name)
    if isinstance(default, cst.Name) and default.value == "True":
        return f"`{name}` defaults to True in {method.name.value}()"
    if default is not None and not (isinstance(default, cst.Name) and default.value == "None"):
        return None
    if any((dotted_name(_decorator_name(d.decorator)) or "").endswith(_CONFIG_DEFAULTS_DECORATOR)
           for d in method.decorators):
        return (f"`{name}=None` is filled from the config ({_CONFIG_DEFAULTS_DECORATOR}), and "
                "transformers' configs set use_cache=True")
    if _assigned_from_config(method, name):
        return f"`{name}` falls back to config.use_cache, and transformers' configs set use_cache=True"
    return None


def _default_of(method: cst.FunctionDef, name: str) -> cst.BaseExpression | None:
    params = [*method.params.params, *method.params.kwonly_params, *method.params.posonly_params]
    for param in params:
        if param.name.value == name:
            return param.default
    return None


def _decorator_name(node: cst.BaseExpression) -> cst.BaseExpression:
    return node.func if isinstance(node, cst.Call) else node


def _assigned_from_config(method: cst.FunctionDef, name: str) -> bool:
    """``name = ... config.use_cache ...`` somewhere in the method (transformers 4)."""
    found = False

    class _Visitor(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            nonlocal found
            if any(isinstance(t.target, cst.Name) and t.target.value == name for t in node.targets):
                found = found or _mentions_config_flag(node.value)

    method.visit(_Visitor())
    return found


def _mentions_config_flag(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.Attribute) and (dotted_name(node) or "").endswith("config.use_cache"):
        return True
    return any(_mentions_config_flag(child) for child in node.children)
