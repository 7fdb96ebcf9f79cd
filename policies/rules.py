"""Rules: named selections of modules, composable with ``|``, ``&`` and ``-``.

A rule looks at a model (through a `ModelIndex`) and returns the module paths it
selects, each with a reason. The reason is the rule's name, so every unit of a Plan
says which rule chose it. Rules only select; which action a selection gets (shard,
checkpoint, offload) is said by a `policies.Policy`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch
from torch import nn

from annot.policies.errors import PlanError
from annot.policies.marks import Action, effective_mark
from annot.policies.model_index import ModelIndex, parent_path
from annot.policies.roles import module_roles

__all__ = [
    "Rule",
    "by_class",
    "by_name",
    "by_role",
    "by_size",
    "every_nth",
    "declared_names",
    "keep_in_fp32_modules",
    "list_elements",
    "marked",
    "modules_named",
    "no_split_modules",
    "repeated_blocks",
]

Selection = dict[str, str]  # module path -> reason, in module order


class Rule(ABC):
    """A named selection of modules. Subclasses implement `select`."""

    name: str

    @abstractmethod
    def select(self, index: ModelIndex) -> Selection:
        """Paths this rule selects in the indexed model, in module order, with reasons."""

    def diagnostics(self, index: ModelIndex) -> list[str]:
        """Things worth telling the user about this rule on this model (not errors)."""
        return []

    def __or__(self, other: Rule) -> Rule:
        return _Union(self, _as_rule(other))

    def __and__(self, other: Rule) -> Rule:
        return _Intersection(self, _as_rule(other))

    def __sub__(self, other: Rule) -> Rule:
        return _Difference(self, _as_rule(other))

    def __repr__(self) -> str:
        return f"<rule {self.name}>"

    def __str__(self) -> str:
        return self.name


def _as_rule(value: object) -> Rule:
    if not isinstance(value, Rule):
        raise TypeError(f"rules combine with rules, not {type(value).__name__}")
    return value


class _Combined(Rule):
    symbol = "?"

    def __init__(self, left: Rule, right: Rule) -> None:
        self.left, self.right = left, right
        self.name = f"{_wrap(left)} {self.symbol} {_wrap(right)}"

    def diagnostics(self, index: ModelIndex) -> list[str]:
        return self.left.diagnostics(index) + self.right.diagnostics(index)


def _wrap(rule: Rule) -> str:
    return f"({rule.name})" if isinstance(rule, _Combined) else rule.name


class _Union(_Combined):
    symbol = "|"

    def select(self, index: ModelIndex) -> Selection:
        left, right = self.left.select(index), self.right.select(index)
        merged = dict(left)
        for path, reason in right.items():
            merged[path] = f"{merged[path]} | {reason}" if path in merged else reason
        return index.ordered(merged)


class _Intersection(_Combined):
    symbol = "&"

    def select(self, index: ModelIndex) -> Selection:
        left, right = self.left.select(index), self.right.select(index)
        return {path: f"{reason} & {right[path]}" for path, reason in left.items() if path in right}


class _Difference(_Combined):
    symbol = "-"

    def select(self, index: ModelIndex) -> Selection:
        left, right = self.left.select(index), self.right.select(index)
        return {path: reason for path, reason in left.items() if path not in right}


class _ByClass(Rule):
    def __init__(self, classes: tuple[type | str, ...]) -> None:
        if not classes:
            raise ValueError("by_class() needs at least one class or class name")
        for c in classes:
            if isinstance(c, type) and not issubclass(c, nn.Module):
                raise TypeError(f"by_class() takes nn.Module classes, not {c.__qualname__}")
            if not isinstance(c, (type, str)):
                raise TypeError(f"by_class() takes classes or dotted names, not {c!r}")
        self.classes = classes
        self.name = f"class({', '.join(_class_label(c) for c in classes)})"

    def matches(self, module: nn.Module) -> bool:
        for wanted in self.classes:
            if isinstance(wanted, type):
                if isinstance(module, wanted):
                    return True
            elif any(_names_class(wanted, klass) for klass in type(module).__mro__):
                return True
        return False

    def select(self, index: ModelIndex) -> Selection:
        return {path: self.name for path, module in index if self.matches(module)}


def _class_label(c: type | str) -> str:
    return c.__name__ if isinstance(c, type) else c


def _names_class(wanted: str, klass: type) -> bool:
    """A bare name matches ``__name__``; a dotted one the full ``module.qualname``."""
    if "." in wanted:
        return f"{klass.__module__}.{klass.__qualname__}" == wanted
    return klass.__name__ == wanted


def by_class(*classes: type[nn.Module] | str) -> Rule:
    """Modules that are instances of any of ``classes`` (types, bare or dotted class names;
    a name matches subclasses too, as ``isinstance`` does)."""
    return _ByClass(classes)


class _ByName(Rule):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        if not patterns:
            raise ValueError("by_name() needs at least one pattern")
        self.patterns = patterns
        self._compiled = []
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    self._compiled.append(re.compile(pattern[3:]))
                except re.error as exc:
                    raise ValueError(f"bad regular expression {pattern[3:]!r}: {exc}") from None
            else:
                self._compiled.append(_glob_to_regex(pattern))
        self.name = f"name({', '.join(patterns)})"

    def select(self, index: ModelIndex) -> Selection:
        return {
            path: self.name
            for path, _ in index
            if path and any(rx.fullmatch(path) for rx in self._compiled)
        }


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Globs over dotted paths: ``*`` stays within one name, ``**`` crosses dots."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    table = {"**": ".*", "*": "[^.]*", "?": "[^.]"}
    return re.compile("".join(table.get(part, re.escape(part)) for part in parts))


def by_name(*patterns: str) -> Rule:
    """Modules whose path matches a glob or, with a ``re:`` prefix, a regular expression
    matched against the whole path. In globs ``*`` matches within one name
    (``transformer.h.*`` selects the blocks, not their children) and ``**`` across dots."""
    return _ByName(patterns)


class _BySize(Rule):
    def __init__(self, min_params: int) -> None:
        if not isinstance(min_params, int) or isinstance(min_params, bool) or min_params < 1:
            raise ValueError(f"by_size() needs a positive whole number of parameters, got {min_params!r}")
        self.min_params = min_params
        self.name = f"size(>={format_count(min_params)})"

    def select(self, index: ModelIndex) -> Selection:
        # Bottom-up, as torch's size-based wrap policy does: a module is selected when the
        # parameters not already covered by selected descendants reach the threshold. The
        # root is never selected: engines always wrap it last anyway.
        remaining: dict[str, int] = {}
        selected: dict[str, str] = {}
        for path in reversed(list(index.modules)):  # children before parents
            total = index.direct_params[path] + remaining.get(path, 0)
            if path and total >= self.min_params:
                selected[path] = self.name
                total = 0
            if path:
                parent = parent_path(path)
                remaining[parent] = remaining.get(parent, 0) + total
        return index.ordered(selected)


def by_size(min_params: int) -> Rule:
    """Bottom-up size rule: a module is selected once the parameters it holds outside
    already-selected descendants reach ``min_params``."""
    return _BySize(min_params)


class _EveryNth(Rule):
    def __init__(self, n: int, of: Rule, offset: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"every_nth() needs n >= 1, got {n!r}")
        if not isinstance(offset, int) or not 0 <= offset < n:
            raise ValueError(f"every_nth() needs 0 <= offset < n, got offset={offset!r}")
        self.n, self.of, self.offset = n, _as_rule(of), offset
        suffix = f", offset={offset}" if offset else ""
        self.name = f"every_nth({n}, {of.name}{suffix})"

    def select(self, index: ModelIndex) -> Selection:
        chosen = list(self.of.select(index).items())
        return {path: f"every_nth({self.n}) of {reason}"
                for i, (path, reason) in enumerate(chosen) if i % self.n == self.offset}

    def diagnostics(self, index: ModelIndex) -> list[str]:
        return self.of.diagnostics(index)


def every_nth(n: int, of: Rule, *, offset: int = 0) -> Rule:
    """Every ``n``-th module (counting from ``offset``) of those ``of`` selects, in model order.
    Typical use: checkpoint every second block to trade less memory for less recompute."""
    return _EveryNth(n, of, offset)


class _Marked(Rule):
    def __init__(self, action: Action | str | None) -> None:
        self.action = Action(action) if action is not None else None
        self.name = f"marked({self.action.value})" if self.action else "marked"

    def select(self, index: ModelIndex) -> Selection:
        out = {}
        for path, module in index:
            actions = effective_mark(module).actions()
            if (self.action in actions) if self.action else actions:
                out[path] = f"marked({type(module).__name__})"
        return out


def marked(action: Action | str | None = None) -> Rule:
    """Modules whose marks (`annot.shard_block` etc., class or instance) ask for ``action``;
    with no action, modules marked for anything."""
    return _Marked(action)


def declared_names(model: nn.Module, attribute: str) -> list[str]:
    """Union of the class names or module names listed in ``attribute`` (a HuggingFace
    list such as ``_no_split_modules``) over ``model`` and every submodule, in first-seen
    order. transformers 5 stores a set per instance; older releases a list on the class."""
    names: list[str] = []
    for module in model.modules():
        value = getattr(module, attribute, None)
        if isinstance(value, str):
            value = [value]
        elif isinstance(value, (set, frozenset)):
            value = sorted(value)
        for name in value or ():
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def modules_named(model: nn.Module, names: list[str]) -> list[str]:
    """Outermost module paths having one of ``names`` as a path component (how
    transformers matches ``_keep_in_fp32_modules``: ``"wo"`` matches
    ``encoder.block.0.layer.1.DenseReluDense.wo``); a dotted name matches a path suffix."""
    chosen: list[str] = []
    for path, _ in model.named_modules():
        if not path or any(path.startswith(c + ".") for c in chosen):
            continue
        parts = path.split(".")
        if any(name in parts or path == name or path.endswith("." + name) for name in names):
            chosen.append(path)
    return chosen


class _KeepInFp32Modules(Rule):
    name = "keep_in_fp32_modules"

    def select(self, index: ModelIndex) -> Selection:
        # Only when they differ from the rest: in an all-fp32 model they are plain modules
        # and a unit of their own would only add communication.
        model = index.model
        loose = _declared(index, "_keep_in_fp32_modules")
        names = loose + [n for n in _declared(index, "_keep_in_fp32_modules_strict") if n not in loose]
        floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if not names or floating <= {torch.float32}:
            return {}
        out = {}
        for path in modules_named(model, names):
            params = list(index.modules[path].parameters())
            if params and all(p.dtype == torch.float32 for p in params):
                out[path] = f"keep_in_fp32_modules({path.rpartition('.')[2]})"
        return out


def keep_in_fp32_modules() -> Rule:
    """HuggingFace ``_keep_in_fp32_modules`` (and ``_strict``) kept in float32 inside a
    lower-precision model: each becomes a unit of its own, so no unit mixes dtypes. Selects
    nothing when the model is all float32."""
    return _KeepInFp32Modules()


def _declared(index: ModelIndex, attribute: str) -> list[str]:
    """`declared_names` of the index's model, walked once per plan."""
    key = f"declared_names:{attribute}"
    if key not in index.memo:
        index.memo[key] = declared_names(index.model, attribute)
    return index.memo[key]


def _collect_no_split(index: ModelIndex) -> list[str]:
    """Union of every ``_no_split_modules`` in the model, the root's and its children's."""
    return _declared(index, "_no_split_modules")


class _NoSplitModules(Rule):
    name = "no_split_modules"

    def select(self, index: ModelIndex) -> Selection:
        wanted = set(_collect_no_split(index))
        named = {path: f"no_split_modules({type(module).__name__})"
                 for path, module in index if path and type(module).__name__ in wanted}
        if not named:
            return {}
        lifted = _lift_into_repeated_blocks(index, named)
        return index.ordered({**lifted, **_uncovered_repeated_blocks(index, lifted)})

    def diagnostics(self, index: ModelIndex) -> list[str]:
        present = {type(m).__name__ for _, m in index}
        return [
            f"_no_split_modules names {name!r}, which does not occur in this model"
            for name in _collect_no_split(index)
            if name not in present
        ]


def _lift_into_repeated_blocks(index: ModelIndex, named: dict[str, str]) -> dict[str, str]:
    """A module named by ``_no_split_modules`` that sits inside a block of the repeated
    trunk (`repeated_blocks`) none of whose ancestors or itself is named: that block
    instead. RoBERTa-PreLayerNorm names only its attention, so its layers' feed-forward
    weights stayed with the root, unsharded; "do not split" holds for the larger block
    too. Where the named module is the block (Llama's decoder layer) or sits under a
    named one, nothing changes. The outermost repeated block is taken (an expert list
    inside a layer is itself repeated)."""
    blocks = _RepeatedBlocks().select(index)
    if not blocks:
        return named
    out: dict[str, str] = {}
    for path, reason in named.items():
        ancestors = [a for a in _ancestors(path) if a in blocks]
        if any(a in named for a in _ancestors(path)) or not ancestors:
            out[path] = reason
            continue
        block = ancestors[-1]  # outermost
        out.setdefault(block, f"{reason} inside {blocks[block]}")
    return out


def _uncovered_repeated_blocks(index: ModelIndex, chosen: Selection) -> Selection:
    """Repeated blocks (`repeated_blocks`) that ``chosen`` neither holds nor reaches into:
    a list of layers ``_no_split_modules`` forgot (Speech2Text names only its encoder's
    layer, so its decoder's stayed with the root, unsharded; BLIP-2's Q-Former layers,
    Qwen3-VL's ``deepstack_merger_list``). "Do not split" says nothing of what the list
    leaves out, and a list of blocks left in the root is gathered whole for every step."""
    out: dict[str, str] = {}
    for path, reason in _RepeatedBlocks().select(index).items():  # outermost first
        covered = any(path == c or path.startswith(c + ".") or c.startswith(path + ".")
                      for c in [*chosen, *out])
        if not covered:
            out[path] = f"{reason}, not in _no_split_modules"
    return out


def _ancestors(path: str) -> list[str]:
    """Strict ancestors of ``path``, innermost first (``a.b.c`` -> ``a.b``, ``a``)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def no_split_modules() -> Rule:
    """HuggingFace blocks: modules whose class is named in any ``_no_split_modules`` of
    the model or its children (read by attribute; transformers is never imported)."""
    return _NoSplitModules()


class _RepeatedBlocks(Rule):
    name = "repeated_blocks"

    def __init__(self, note: str | None = None) -> None:
        self.note = note

    def diagnostics(self, index: ModelIndex) -> list[str]:
        return [self.note] if self.note else []

    def select(self, index: ModelIndex) -> Selection:
        out = {}
        for path, module in index:
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                children = list(module.children())
                kinds = {type(child) for child in children}
                # Lists of lists (Florence-2's stages of blocks): a list has no forward to
                # shard around; the inner lists' elements are found on their own.
                if len(children) >= 2 and len(kinds) == 1 and not _is_bare_container(children[0]) and any(
                    True for _ in children[0].parameters()
                ):
                    for child_path in index.children_paths(path):
                        if child_path in index.modules:
                            out[child_path] = f"repeated_blocks({type(children[0]).__name__})"
        return index.ordered(out)


def _is_bare_container(module: nn.Module) -> bool:
    """A module without a ``forward`` of its own (a module list or dict, a bare
    ``nn.Module`` holding attributes, as Chameleon's VQ encoder groups each level's
    blocks): its parent calls what it holds, never it, so FSDP2's hooks around its
    forward would never gather its parameters. Never a unit."""
    return type(module).forward is nn.Module.forward


def repeated_blocks(*, note: str | None = None) -> Rule:
    """The trunk: elements of an ``nn.ModuleList``/``nn.Sequential`` of two or more modules
    of one class that hold parameters (the fallback when a model carries no metadata).
    ``note`` is reported with the plan's warnings (to say that a fallback happened)."""
    return _RepeatedBlocks(note)


class _ListElements(Rule):
    name = "list_elements"

    def __init__(self, note: str | None = None) -> None:
        self.note = note

    def diagnostics(self, index: ModelIndex) -> list[str]:
        return [self.note] if self.note else []

    def select(self, index: ModelIndex) -> Selection:
        out: dict[str, str] = {}
        for path, module in index:
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and not any(
                    path == p or path.startswith(p + ".") for p in out):
                for child_path in index.children_paths(path):
                    child = index.modules.get(child_path)
                    if child is not None and not _is_bare_container(child) and any(
                            True for _ in child.parameters()):
                        out[child_path] = f"list_elements({type(child).__name__})"
        return index.ordered(out)


def list_elements(*, note: str | None = None) -> Rule:
    """The elements holding parameters of every ``nn.ModuleList``/``nn.Sequential`` not
    inside another one's element, however many and of whatever classes: the last
    fallback for a model with neither metadata nor a repeated trunk (ALBERT keeps one
    layer that every depth calls: it becomes one unit, gathered at each use)."""
    return _ListElements(note)


class _ByRole(Rule):
    def __init__(self, roles: tuple[str, ...]) -> None:
        if not roles or not all(isinstance(r, str) for r in roles):
            raise ValueError("by_role() needs role names such as 'vision', 'projector', 'language'")
        self.roles = roles
        self.name = f"role({', '.join(roles)})"

    def select(self, index: ModelIndex) -> Selection:
        return {path: f"role({role})" for path, role in _roles(index).items() if role in self.roles}

    def diagnostics(self, index: ModelIndex) -> list[str]:
        found = set(_roles(index).values())
        missing = [r for r in self.roles if r not in found]
        if not missing:
            return []
        return [f"by_role: {type(index.model).__name__} has no part with role {', '.join(map(repr, missing))} "
                f"(its parts: {', '.join(sorted(found)) or 'none'})"]


def _roles(index: ModelIndex) -> dict[str, str]:
    """`module_roles` of the index's model, found once per plan."""
    if "roles" not in index.memo:
        index.memo["roles"] = module_roles(index.model)
    return index.memo["roles"]


def by_role(*roles: str) -> Rule:
    """The outermost module of each part of the model with one of ``roles``
    (`annot.policies.roles`: ``"vision"``, ``"audio"``, ``"projector"``, ``"language"``,
    ``"encoder"``, ``"decoder"``, ``"denoiser"``): the vision tower as one module, say.
    Use it to choose what to freeze or to treat differently (``Policy.override``)."""
    return _ByRole(roles)


def format_count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def check_selection(rule: Rule, selection: Selection, what: str) -> None:
    if not selection:
        raise PlanError(
            f"rule {rule.name} selects no module for {what}; nothing would happen. "
            "Fix the rule (check class names and paths with `annot plan --policy ...`) "
            f"or drop the {what} selection."
        )
