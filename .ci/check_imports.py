#!/usr/bin/env python3
"""Check annot's import contract (docs/design.md, "The import check").

Parses every ``.py`` file under ``annot/`` (following the symbolic links
``annot/policies`` and ``annot/rewriter``, whose modules are named ``annot.policies.x`` and
``annot.rewriter.x``) and collects every import statement: module level, inside
functions, under ``TYPE_CHECKING``, relative ones resolved. Strings are not imports: the
lazy ``_EXPORTS`` table of ``annot/__init__.py`` is not read. It reports:

- import cycles among annot's own modules (strongly connected components of more than
  one module, and any module that imports itself), with the edges that form them;
- direction violations: ``annot.policies`` importing annot outside ``annot.policies``, or
  ``torch.distributed``, ``deepspeed``, ``transformers``, ``peft``; ``annot.checkpoint_io``
  importing a format package (``annot.huggingface``, ``annot.formats``, ``transformers``,
  ``peft``, ``diffusers``); ``annot.rewriter``
  importing anything but ``annot.rewriter``, ``libcst`` and the standard library; the old
  top-level names ``policies`` / ``rewriter``; a lower layer of `LAYERS` importing a
  higher one; a module `LAYERS` does not place;
- engine internals outside engines: ``deepspeed`` or ``torch.distributed.fsdp`` imported
  by a module outside ``annot/engines/``;
- engine modules outside their engine: a generic module importing one engine's module
  (`engine_of`: ``annot.engines.<engine>`` and ``annot.engines.<engine>_<part>`` for each
  engine of `ENGINE_NAMES`), or one engine's module importing another engine's. Generic
  is every other module of annot, ``annot/engines/`` included, except those of
  `ENGINE_DISPATCH` (the registry, the package root's typing-only re-exports) and the
  imports `ENGINE_AWARE` lists with their reason.

Exit status: 0 when all four are empty, 1 otherwise, 2 when a file does not parse.
Standard library only. Usage: ``python .ci/check_imports.py [ROOT]``, ROOT being the
directory that holds ``annot/`` (default: this repository).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "annot"

# The layer table of docs/design.md, lowest first. A module may import its own layer and
# the layers below it, never one above. A module belongs to the entry with the longest
# matching prefix ("annot.huggingface.pretrained" before "annot.huggingface"); the package
# root "annot" matches itself only. Keep this table and docs/design.md in step.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("policies, rewriter", ("annot.policies", "annot.rewriter")),
    ("errors, _progress, _version, _deprecation, markers, planning, freezing, module_state, devices, host_memory, process_group, data_loading, quantized_tensors",
     ("annot.errors", "annot._progress", "annot._version", "annot._deprecation", "annot.markers",
      "annot.planning", "annot.freezing", "annot.module_state", "annot.devices", "annot.host_memory",
      "annot.process_group", "annot.collective_hangs", "annot.data_loading", "annot.quantized_tensors")),
    ("huggingface detection", ("annot.huggingface",)),
    ("runtime, meta, compiled_blocks", ("annot.runtime", "annot.meta", "annot.compiled_blocks")),
    ("checkpoint_io", ("annot.checkpoint_io",)),
    ("formats", ("annot.formats",)),
    ("quantization, float8", ("annot.quantization", "annot.float8")),
    ("engines", ("annot.engines", "annot.engines.tensor_parallel")),
    ("wrap, values", ("annot.wrap", "annot.values", "annot.training_state", "annot.resume",
                      "annot.interruptions")),
    ("huggingface.pretrained", ("annot.huggingface.pretrained",)),
    ("trainer integrations", ("annot.lightning", "annot.accelerate")),
    ("memory", ("annot.memory",)),
    ("cli, verify", ("annot.cli", "annot.verify")),
    ("deprecated import paths (0.1 names, warn until 0.3)",
     ("annot.loading", "annot.saving", "annot.deferred", "annot.materialization",
      "annot.activation_checkpoint", "annot.activation_offload")),
    ("package root (lazy re-exports)", ("annot",)),
]

POLICIES = "annot.policies"
REWRITER = "annot.rewriter"
ENGINES = "annot.engines"
POLICIES_FORBIDDEN = ("torch.distributed", "deepspeed", "transformers", "peft")
# The generic loader and saver know no checkpoint format: a format reaches them as data
# (annot.checkpoint_io.formats.CheckpointFormat) from the adapters of annot.formats.
CHECKPOINT_IO = "annot.checkpoint_io"
FORMAT_PACKAGES = ("annot.huggingface", "annot.formats", "transformers", "peft", "diffusers")
REWRITER_ALLOWED_EXTERNAL = ("libcst",)
ENGINE_INTERNALS = ("deepspeed", "torch.distributed.fsdp")
# The engines annot wraps. One engine's modules are annot.engines.<name> and
# annot.engines.<name>_<part> (deepspeed_config, deepspeed_state, deepspeed_partitions):
# what a new engine adds lives in modules named so, and nothing generic imports them.
ENGINE_NAMES = ("ddp", "fsdp1", "fsdp2", "deepspeed")
# Generic modules that may import any engine's module: the registry finds an engine by its
# name; the package root re-exports engines' option types (under TYPE_CHECKING only).
ENGINE_DISPATCH = ("annot.engines.registry", "annot")
# Single imports of one engine's module by a module built around that engine, with why.
ENGINE_AWARE: dict[tuple[str, str], str] = {
    ("annot.lightning", "annot.engines.fsdp2"):
        "the Lightning strategies are FSDP2's (ModelParallelStrategy)",
    ("annot.memory.engine_memory", "annot.engines.deepspeed_config"):
        "the memory model reads the DeepSpeed config annot writes (pitfall 16)",
    ("annot.memory.report", "annot.engines.deepspeed_config"):
        "the memory model reads the DeepSpeed config annot writes (pitfall 16)",
}
# The names policies/ and rewriter/ had before they became subpackages of annot.
OLD_TOP_LEVEL = ("policies", "rewriter")


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def under_any(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(under(name, p) for p in prefixes)


def engine_of(name: str) -> str | None:
    """The engine whose module ``name`` is (``annot.engines.deepspeed_state``: deepspeed),
    or None for a generic module."""
    prefix = ENGINES + "."
    if not name.startswith(prefix):
        return None
    leaf = name[len(prefix):].split(".")[0]
    for engine in ENGINE_NAMES:
        if leaf == engine or leaf.startswith(engine + "_"):
            return engine
    return None


@dataclass(frozen=True)
class Module:
    name: str
    path: Path  # as seen under ROOT (through the symbolic links), for messages
    is_package: bool


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    line: int
    text: str  # the statement, shortened
    target: str  # the module imported: "a.b.c", or "a.b" for a name of a.b
    names: tuple[str, ...]  # every dotted name it brings in (target and target.x)

    def where(self, modules: dict[str, Module]) -> str:
        return f"{modules[self.source].path}:{self.line}"


def find_modules(root: Path) -> dict[str, Module]:
    """Every module under ROOT/annot, symbolic links followed, named by its path."""
    modules: dict[str, Module] = {}
    seen: set[str] = set()
    base = root / PACKAGE
    for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link loop, or one folder reached twice
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        rel = Path(dirpath).relative_to(root)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            parts = list(rel.parts)
            if filename != "__init__.py":
                parts.append(filename[:-3])
            name = ".".join(parts)
            modules[name] = Module(name, rel / filename, filename == "__init__.py")
    return modules


def _statement(node: ast.Import | ast.ImportFrom) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 90 else text[:87] + "..."


def collect_imports(module: Module, tree: ast.AST, known: set[str]) -> list[Import]:
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module.name, node.lineno, _statement(node), alias.name,
                                    (alias.name,)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.name.split(".")
                if not module.is_package:
                    package = package[:-1]
                if node.level - 1:
                    package = package[: -(node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if alias.name != "*" and full in known:
                    found.append(Import(module.name, node.lineno, _statement(node), full,
                                        (full,)))
                else:
                    names = (base,) if alias.name == "*" else (base, full)
                    found.append(Import(module.name, node.lineno, _statement(node), base, names))
    # one entry per (statement, target): `from annot.policies import Plan, Rule` is one edge
    unique: dict[tuple[int, str], Import] = {}
    for imp in found:
        unique.setdefault((imp.line, imp.target), imp)
    return list(unique.values())


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix if prefix == PACKAGE else under(name, prefix)
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def describe(name: str) -> str:
    layer = layer_of(name)
    return f"{name} ({LAYERS[layer][0]})" if layer is not None else name


def check(root: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """The report: (cycle lines, direction violation lines, engine-internal lines,
    engine-module lines)."""
    modules = find_modules(root)
    known = set(modules)
    imports: list[Import] = []
    for module in modules.values():
        source = (root / module.path).read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(module.path))
        imports.extend(collect_imports(module, tree, known))
    imports.sort(key=lambda i: (str(modules[i.source].path), i.line, i.target))

    # cycles
    graph: dict[str, set[str]] = {name: set() for name in modules}
    edge_lines: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in imports:
        if imp.target in known:
            graph[imp.source].add(imp.target)
            edge_lines[(imp.source, imp.target)].append(imp)
    cycles: list[str] = []
    components = [c for c in strongly_connected(graph) if len(c) > 1]
    components += [[n] for n in sorted(graph) if n in graph[n]]
    for number, component in enumerate(sorted(components), 1):
        cycles.append(f"cycle {number} ({len(component)} modules): {', '.join(component)}")
        members = set(component)
        for (src, dst), via in sorted(edge_lines.items()):
            if src in members and dst in members:
                lines = ", ".join(str(i.line) for i in via)
                cycles.append(f"    {src} -> {dst}  ({modules[src].path}:{lines}: {via[0].text})")

    # direction
    violations: list[str] = []
    unplaced = sorted(name for name in modules if layer_of(name) is None)
    for name in unplaced:
        violations.append(f"{modules[name].path}: {name} has no layer: add it to LAYERS in "
                          f".ci/check_imports.py and to the table in docs/design.md")
    engine_internals: list[str] = []
    engine_modules: list[str] = []
    for imp in imports:
        src, dst = imp.source, imp.target
        where = imp.where(modules)
        internal = under(dst, PACKAGE)
        if internal and dst not in known:
            violations.append(f"{where}: {src} imports {dst}, which is no module of annot "
                              f"({imp.text})")
        if any(under_any(n, OLD_TOP_LEVEL) for n in imp.names):
            violations.append(f"{where}: {src} imports the old top-level name {dst}; use "
                              f"annot.{dst} ({imp.text})")
        elif under(src, POLICIES):
            if internal and not under(dst, POLICIES):
                violations.append(f"{where}: policies imports {dst}: annot.policies imports "
                                  f"nothing else of annot ({imp.text})")
            elif any(under_any(n, POLICIES_FORBIDDEN) for n in imp.names):
                violations.append(f"{where}: policies imports {dst}: torch.nn only, never "
                                  f"torch.distributed, deepspeed, transformers, peft "
                                  f"({imp.text})")
        elif under(src, REWRITER):
            top = dst.split(".")[0]
            allowed = (under(dst, REWRITER) if internal else
                       top in sys.stdlib_module_names or under_any(dst, REWRITER_ALLOWED_EXTERNAL))
            if not allowed:
                violations.append(f"{where}: rewriter imports {dst}: only annot.rewriter, "
                                  f"libcst and the standard library ({imp.text})")
        elif under(src, CHECKPOINT_IO) and any(under_any(n, FORMAT_PACKAGES) for n in imp.names):
            violations.append(f"{where}: checkpoint_io imports {dst}: the generic loader and "
                              f"saver import no format package (annot.huggingface, "
                              f"annot.formats, transformers, peft, diffusers); a format "
                              f"reaches them as a CheckpointFormat ({imp.text})")
        elif internal and dst in known:
            src_layer, dst_layer = layer_of(src), layer_of(dst)
            if src_layer is not None and dst_layer is not None and src_layer < dst_layer:
                violations.append(f"{where}: {describe(src)} imports {describe(dst)}: a lower "
                                  f"layer imports a higher one ({imp.text})")
        if not under(src, ENGINES) and any(under_any(n, ENGINE_INTERNALS) for n in imp.names):
            engine_internals.append(f"{where}: {src} imports {dst} ({imp.text})")
        line = _engine_module_import(src, dst, where, imp.text) if dst in known else None
        if line:
            engine_modules.append(line)
    return cycles, violations, engine_internals, engine_modules


def _engine_module_import(src: str, dst: str, where: str, text: str) -> str | None:
    """The report line for ``src`` importing ``dst`` if that breaks the engine contract."""
    engine, src_engine = engine_of(dst), engine_of(src)
    if engine is None or src_engine == engine or src in ENGINE_DISPATCH:
        return None
    if src_engine is not None:
        return (f"{where}: {src} ({src_engine}) imports {dst}, a module of engine {engine}: "
                f"an engine's modules import only their own engine's ({text})")
    if (src, dst) in ENGINE_AWARE:
        return None
    return (f"{where}: {src} imports {dst}, a module of engine {engine}: generic modules ask "
            f"the engine contract (annot.engines.base, found through annot.engines.registry) "
            f"({text})")


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    if not (root / PACKAGE).is_dir():
        print(f"check_imports: no {PACKAGE}/ under {root}", file=sys.stderr)
        return 2
    try:
        cycles, violations, engine_internals, engine_modules = check(root)
    except SyntaxError as e:
        print(f"check_imports: {e.filename}:{e.lineno}: {e.msg}", file=sys.stderr)
        return 2
    n_cycles = sum(1 for line in cycles if line.startswith("cycle "))
    for title, lines in (("import cycles", cycles), ("direction violations", violations),
                         ("engine internals outside engines", engine_internals),
                         ("engine modules outside their engine", engine_modules)):
        if lines:
            print(f"{title}:")
            for line in lines:
                print(f"  {line}")
    print(f"cycles: {n_cycles}, direction violations: {len(violations)}, "
          f"engine internals outside engines: {len(engine_internals)}, "
          f"engine modules outside their engine: {len(engine_modules)}")
    return 1 if n_cycles or violations or engine_internals or engine_modules else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
