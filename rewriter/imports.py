"""Which names a module binds to which imported objects, and how to reach one from code.

Resolution is purely syntactic: ``import torch.utils.checkpoint as cp`` makes ``cp``
stand for ``torch.utils.checkpoint``; ``from .layers import Block as B`` makes ``B`` stand
for ``.layers.Block``. Only imports at module level count (also inside module-level
``try``/``if``, which is how optional dependencies are imported), because the code we emit
runs in ``forward`` and sees module globals.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst

__all__ = ["ImportTable", "dotted_name", "import_marker"]

# Trailing comment on every import line annot adds; `--undo` removes exactly those lines.
import_marker = "# annot: import"


def dotted_name(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))


def _module_name(node: cst.Attribute | cst.Name | None, dots: int) -> str:
    name = dotted_name(node) if node is not None else ""
    return "." * dots + (name or "")


def _toplevel_statements(body: Sequence[cst.BaseStatement]) -> Iterator[cst.BaseStatement]:
    """Module-level statements, descending into ``try``/``if``/``else`` but not defs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, cst.Try | cst.If):
            blocks: list[cst.BaseSuite] = [stmt.body]
            if isinstance(stmt, cst.Try):
                blocks += [h.body for h in stmt.handlers]
                if stmt.orelse is not None:
                    blocks.append(stmt.orelse.body)
            else:
                orelse = stmt.orelse
                while isinstance(orelse, cst.If):
                    blocks.append(orelse.body)
                    orelse = orelse.orelse
                if orelse is not None:
                    blocks.append(orelse.body)
            for block in blocks:
                if isinstance(block, cst.IndentedBlock):
                    yield from _toplevel_statements(block.body)


@dataclass
class ImportTable:
    """Local name -> qualified name for the module's imports, plus every name it binds."""

    names: dict[str, str] = field(default_factory=dict)
    #: modules imported as such (``import a.b.c`` records a, a.b, a.b.c)
    modules: set[str] = field(default_factory=set)
    #: names bound at module level by anything else (def, class, assignment)
    other_bindings: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, module: cst.Module) -> ImportTable:
        table = cls()
        for stmt in _toplevel_statements(module.body):
            if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
                table.other_bindings.add(stmt.name.value)
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    table.add_import(small)
                elif isinstance(small, cst.ImportFrom):
                    table._add_import_from(small)
                elif isinstance(small, cst.Assign):
                    for target in small.targets:
                        if isinstance(target.target, cst.Name):
                            table._rebind(target.target.value)
        return table

    def _rebind(self, name: str) -> None:
        # `deepspeed = None` in an `except ImportError` keeps the import binding usable:
        # that is the optional-dependency pattern, which must keep working.
        if name not in self.names:
            self.other_bindings.add(name)

    def add_import(self, node: cst.Import) -> None:
        for alias in node.names:
            full = dotted_name(alias.name) or ""
            parts = full.split(".")
            for i in range(1, len(parts) + 1):
                self.modules.add(".".join(parts[:i]))
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self.names[alias.asname.name.value] = full
            else:
                self.names[parts[0]] = parts[0]

    def _add_import_from(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        base = _module_name(node.module, len(node.relative))
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            local = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            full = f"{base}.{name}" if base and not base.endswith(".") else base + name
            self.names[local] = full
            # `from torch.utils import checkpoint` may be a submodule: it is imported then.
            self.modules.add(full)

    def resolve(self, node: cst.BaseExpression) -> str | None:
        """Qualified name of an expression such as ``cp.checkpoint``; None if not imported."""
        name = dotted_name(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head not in self.names:
            return None
        base = self.names[head]
        return f"{base}.{rest}" if rest else base

    def is_bound(self, name: str) -> bool:
        return name in self.names or name in self.other_bindings

    def reference(self, qualified: str, *, needs_module: str | None = None) -> str | None:
        """Code reaching ``qualified`` through an existing import, or None.

        ``needs_module`` names a submodule that must have been imported for attribute
        access to work (``torch.utils.checkpoint`` is not loaded by ``import torch``).
        """
        best: str | None = None
        for local, full in self.names.items():
            if local in self.other_bindings:
                continue
            if qualified == full:
                code = local
            elif qualified.startswith(full + "."):
                if needs_module is not None and needs_module not in self.modules:
                    continue
                code = local + qualified[len(full) :]
            else:
                continue
            if best is None or len(code) < len(best):
                best = code
        return best
