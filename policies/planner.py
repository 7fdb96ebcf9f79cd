"""make_plan: (model, policy) -> validated Plan, without allocating.

The steps, in order: pick the policy (given, else marks, else HuggingFace metadata);
run each action's rule; apply overrides; find which shard unit owns each parameter;
group or reject tied parameters split across units; count trainable parameters per
unit and warn where a unit mixes dtypes, naming the engines that take it (each engine
refuses what it cannot shard); list the mixture-of-experts blocks (`annot.policies.experts`). Every error names the module paths and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict

import torch
from torch import nn

from annot.policies.errors import PlanError
from annot.policies.experts import find_moe_blocks
from annot.policies.marks import Action, effective_mark
from annot.policies.model_index import ModelIndex, is_under, parent_path, qualified_class_name
from annot.policies.plan import Plan, RootInfo, Unit
from annot.policies.policy import Policy
from annot.policies.roles import TOWERS, module_roles, role_of
from annot.policies.rules import (
    Rule,
    check_selection,
    keep_in_fp32_modules,
    list_elements,
    marked,
    no_split_modules,
    repeated_blocks,
)
from annot.policies.speed import with_float8_counts

__all__ = ["cache_writers", "default_policy", "make_plan", "unit_parameters"]

ROOT = ""


def default_policy(model: nn.Module) -> Policy:
    """The model's marks if any module is marked, else its HuggingFace ``_no_split_modules``;
    a HuggingFace model without that list falls back to its repeated-block trunk, and the
    plan says so in its warnings."""
    index = ModelIndex(model)
    if marked().select(index):
        return Policy.from_marks()
    if no_split_modules().select(index):
        return Policy.from_hf()
    if _is_huggingface(model):
        note = (f"{type(model).__name__} declares no _no_split_modules: fell back to its "
                "repeated-block trunk (repeated_blocks); pass a policy to choose the blocks")
        trunk = repeated_blocks(note=note)
        if not trunk.select(index):
            # ALBERT: one layer every depth calls, in lists of one.
            trunk = list_elements(note=(
                f"{type(model).__name__} declares no _no_split_modules and repeats no block: "
                "fell back to the elements of its module lists (list_elements); a module that "
                "several depths call is one unit, gathered at each call; pass a policy to choose"))
        if trunk.select(index):
            return Policy(shard=trunk | keep_in_fp32_modules(), checkpoint=trunk, group_tied=True,
                          split_dtypes=True, towers="blocks")
    raise PlanError(
        f"{type(model).__name__} has no marked blocks and no HuggingFace _no_split_modules, "
        "so there is nothing to decide from: mark the block class (@annot.shard_block), "
        "call annot.mark(BlockClass, shard=True), or pass a policy such as "
        "Policy(shard=by_class(Block))."
    )


def _is_huggingface(model: nn.Module) -> bool:
    """A transformers PreTrainedModel, recognised without importing transformers."""
    return hasattr(type(model), "_no_split_modules") and hasattr(model, "config")


def make_plan(model: nn.Module, policy: Policy | Rule | None = None) -> Plan:
    """Plan ``model`` (best on the meta device) under ``policy``.

    A bare rule means ``Policy(shard=rule)``. Raises `PlanError` when the plan would be
    wrong or would do nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_plan() needs an nn.Module, got {type(model).__name__}")
    if isinstance(policy, Rule):
        policy = Policy(shard=policy)
    index = ModelIndex(model)
    lenient = policy is None  # marks / HF metadata may leave an action unused
    policy = policy if policy is not None else default_policy(model)

    actions: dict[str, set[Action]] = defaultdict(set)
    reasons: dict[str, list[str]] = defaultdict(list)
    warnings: list[str] = []
    for action, rule in policy.rules().items():
        selection = rule.select(index)
        if not lenient:
            check_selection(rule, selection, action.value)
        for path, reason in selection.items():
            actions[path].add(action)
            reasons[path].append(f"{action.value}: {reason}")
        warnings += [w for w in rule.diagnostics(index) if w not in warnings]
    for override in policy.overrides:
        selection = override.rule.select(index)
        check_selection(override.rule, selection, "an override")
        for path in selection:
            for action, value in override.changes().items():
                (actions[path].add if value else actions[path].discard)(action)
            reasons[path].append(f"override: {override.rule.name}")

    units = [
        _make_unit(index, path, acts, "; ".join(_merge_reasons(reasons[path])), policy)
        for path, acts in actions.items()
        if acts
    ]
    if not units:
        raise PlanError(
            f"policy ({policy.describe()}) selects no module of {type(model).__name__}: "
            "the plan would do nothing. Check the rule against the module tree "
            "(print(model)) or mark the block class with @annot.shard_block."
        )
    roles = module_roles(model)
    if lenient and _is_huggingface(model):
        units, note = _no_checkpoint_of_cache_writers(index, units)
        warnings += note
        if any(role in TOWERS for role in roles.values()):
            units, note = _input_embeddings_with_the_root(model, index, units)
            warnings += note
    if policy.towers is not None:
        units = _tower_units(index, units, roles, policy.towers)
    units = _order_bottom_up(index, units)
    tied = _tied_groups(model)
    units = _order_bottom_up(index, _resolve_ties(index, units, tied, policy.group_tied))
    if policy.split_dtypes:
        units = _split_dtypes(index, units)
    units = [dataclasses.replace(u, role=role_of(u.path, roles)) for u in units]
    units = _no_checkpoint_of_frozen_towers(model, units, roles)
    owned = _ownership(model, units)
    warnings += _dtype_warnings(index, units, owned)
    units = with_float8_counts(model, [_with_counts(u, owned.get(u.path, []), index) for u in units])
    root_params = owned.get(ROOT, [])
    return Plan(
        model=type(model).__name__,
        policy=policy.describe() if not lenient else f"default: {policy.describe()}",
        units=tuple(units),
        root=RootInfo(
            params=sum(p.numel() for _, p in root_params),
            bytes=_bytes_by_dtype(p for _, p in root_params),
            modules=tuple(dict.fromkeys(parent_path(n) or "(root)" for n, _ in root_params)),
            trainable=sum(p.numel() for _, p in root_params if p.requires_grad),
        ),
        tied=tuple(tuple(group) for group in tied),
        total_params=sum(p.numel() for p in model.parameters()),
        total_bytes=_bytes_by_dtype(model.parameters()),
        warnings=tuple(warnings),
        moe=tuple(find_moe_blocks(index)),
        root_role=roles.get(ROOT),
    )


#: Names under which a transformers module's ``forward`` takes a key/value cache it may
#: write into.
_CACHE_PARAMETERS = frozenset({"cache", "past_key_value", "past_key_values", "layer_past",
                               "cache_params"})


def _forward_parameters(index: ModelIndex, module: nn.Module) -> frozenset[str]:
    """Parameter names of ``module.forward``, read once per class and plan."""
    memo = index.memo.setdefault("forward_parameters", {})
    cls = type(module)
    if cls not in memo:
        try:
            memo[cls] = frozenset(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            memo[cls] = frozenset()
    return memo[cls]


def cache_writers(model: nn.Module, paths: list[str]) -> list[str]:
    """Those of ``paths`` (module paths of ``model``) that must not be checkpointed: in a
    HuggingFace model none of whose modules takes ``use_cache``, the ones whose subtree
    takes a key/value cache. Such a model cannot be told to train without a cache (XLM
    builds one on every forward), so a checkpointed module taking it would write it again
    when recomputed and read its own keys twice (docs/design.md, pitfall 14). A model with
    the switch gives none: `auto_wrap` passes ``use_cache=False`` to a root that takes it,
    and an encoder's inner model (BERT's) leaves its cache off by itself."""
    if not _is_huggingface(model):
        return []
    return _cache_writers(ModelIndex(model), paths)


def _cache_writers(index: ModelIndex, paths: list[str]) -> list[str]:
    if any("use_cache" in _forward_parameters(index, module) for _, module in index):
        return []
    return [unit_path for unit_path in paths
            if any(not _CACHE_PARAMETERS.isdisjoint(_forward_parameters(index, module))
                   for path, module in index if is_under(path, unit_path))]


def _no_checkpoint_of_cache_writers(index: ModelIndex, units: list[Unit]) -> tuple[list[Unit], list[str]]:
    """The default policy keeps the units `cache_writers` names sharded and does not
    checkpoint them; the plan says so."""
    dropped = _cache_writers(index, [u.path for u in units if u.has(Action.CHECKPOINT)])
    if not dropped:
        return units, []
    kept = [dataclasses.replace(
        unit, actions=tuple(a for a in unit.actions if a is not Action.CHECKPOINT),
        reason=unit.reason + "; not checkpointed: writes a key/value cache")
        if unit.path in dropped else unit for unit in units]
    return kept, [f"not checkpointed: {', '.join(dropped)} take a key/value cache that "
                  f"{type(index.model).__name__} cannot turn off (no module takes use_cache); "
                  "recomputing them would write it twice"]


def _input_embeddings_with_the_root(model: nn.Module, index: ModelIndex, units: list[Unit]
                                    ) -> tuple[list[Unit], list[str]]:
    """The default policy does not shard apart the module that holds a multimodal
    model's input embeddings (``get_input_embeddings()``) when that module is a unit of
    its own (ModernVBERT's ``ModernBertEmbeddings``, from ``_no_split_modules``):
    multimodal models embed their text by calling ``get_input_embeddings()`` outside
    that unit's forward, before it runs (a text model, BERT, embeds inside it), and an
    engine that reduces a unit's gradients after its backward had reduced before the
    embedding's gradient arrived (docs/design.md, pitfall 61). The root holds it, as it
    holds most models' embeddings."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = getter() if callable(getter) else None
    except NotImplementedError:
        return units, []
    path = next((p for p, m in model.named_modules() if m is embeddings), None) if embeddings is not None else None
    if not path:
        return units, []
    holder = parent_path(path)
    # Only a unit that is the embeddings' own container: never one holding other units
    # (a whole language model made one unit keeps its sharding).
    dropped = [u.path for u in units if u.has(Action.SHARD) and u.path in (path, holder) and not u.group
               and not any(v.path != u.path and is_under(v.path, u.path) for v in units)]
    if not dropped:
        return units, []
    kept = [dataclasses.replace(unit, actions=tuple(a for a in unit.actions if a is not Action.SHARD),
                                reason=unit.reason + "; not sharded apart: holds the input embeddings")
            if unit.path in dropped else unit for unit in units]
    return [u for u in kept if u.actions], [
        f"{', '.join(dropped)} not sharded apart: {type(model).__name__} embeds through "
        "get_input_embeddings(), outside that unit's forward; the root holds it"]


def _tower_units(index: ModelIndex, units: list[Unit], roles: dict[str, str], mode: str) -> list[Unit]:
    """Each vision or audio tower (`annot.policies.roles`) a shard unit of its own, so what
    its blocks leave (patch embeddings, norms, a merger inside it) is not gathered with
    the root for the whole step, and each projector outside the towers a unit too (one
    module per unit: FSDP1 wraps no group). ``mode="whole"``: the tower is the only shard
    unit in it, its blocks keep their checkpointing; ``"blocks"``: the blocks stay units
    of their own inside it."""
    towers = [path for path, role in roles.items() if role in TOWERS and path]
    if not towers:
        return units
    projectors = [path for path, role in roles.items() if role == "projector"
                  and not any(is_under(path, t) for t in towers)]
    out = list(units)
    if mode == "whole":
        out = [dataclasses.replace(u, actions=tuple(a for a in u.actions if a is not Action.SHARD),
                                   reason=u.reason + f"; not sharded apart: inside the {roles[tower]} tower's unit")
               if u.has(Action.SHARD) and tower else u
               for u in out for tower in [next((t for t in towers if is_under(u.path, t) and u.path != t), "")]]
        out = [u for u in out if u.actions]
    by_path = {u.path: u for u in out}
    for path in [*towers, *projectors]:
        what = f"{roles[path]} tower" if path in towers else "projector"
        reason = f"shard: towers={mode} ({what})"
        existing = by_path.get(path)
        if existing is not None:
            if not existing.has(Action.SHARD):
                merged = dataclasses.replace(existing, actions=tuple(a for a in Action if a in {*existing.actions, Action.SHARD}),
                                             reason=existing.reason + "; " + reason)
                out = [merged if u.path == path else u for u in out]
        elif not any(is_under(path, u.path) and u.has(Action.SHARD) and u.path for u in out):
            out.append(Unit(path=path, cls=qualified_class_name(index.modules[path]), params=0, bytes={},
                            actions=(Action.SHARD,), reason=reason))
    return out


def _no_checkpoint_of_frozen_towers(model: nn.Module, units: list[Unit], roles: dict[str, str]) -> list[Unit]:
    """A vision or audio tower none of whose parameters trains computes nothing backward
    needs (its input, the pixels or audio, needs no gradient either): checkpointing its
    blocks would only rerun them. Their checkpoint action is dropped, with the reason."""
    frozen = [path for path, role in roles.items() if role in TOWERS and path
              and not any(p.requires_grad for p in model.get_submodule(path).parameters())]
    if not frozen:
        return units
    return [dataclasses.replace(u, actions=tuple(a for a in u.actions if a is not Action.CHECKPOINT),
                                reason=u.reason + f"; not checkpointed: the {u.role} tower is frozen "
                                "(nothing in it needs a gradient)")
            if u.has(Action.CHECKPOINT) and any(is_under(u.path, t) for t in frozen) else u
            for u in units]


def _merge_reasons(reasons: list[str]) -> list[str]:
    """``shard: X; checkpoint: X`` reads better as ``shard,checkpoint: X``."""
    by_reason: dict[str, list[str]] = {}
    for item in reasons:
        head, _, tail = item.partition(": ")
        by_reason.setdefault(tail, []).append(head)
    return [f"{','.join(heads)}: {tail}" for tail, heads in by_reason.items()]


def _make_unit(index: ModelIndex, path: str, acts: set[Action], reason: str, policy: Policy) -> Unit:
    module = index.modules[path]
    offload_to = None
    if Action.OFFLOAD in acts:
        offload_to = effective_mark(module).offload_target or policy.offload_to
    return Unit(
        path=path,
        cls=qualified_class_name(module),
        params=0,
        bytes={},
        actions=tuple(a for a in Action if a in acts),
        reason=reason,
        offload_to=offload_to,
        float8_recipe=policy.float8_recipe if Action.FLOAT8 in acts else None,
    )


def _order_bottom_up(index: ModelIndex, units: list[Unit]) -> list[Unit]:
    """Post-order: a unit comes after every unit nested in it (FSDP wraps inside-out).
    A grouped unit (tied parameters) comes after the units nested in any of its members:
    Zamba's shared block at layers 2 and 7 sharded before layer 7's own sub-unit, which
    then found its parameters already sharded."""
    last = {}
    for unit in units:
        last[unit.path] = max(index.position[p] for member in unit.modules
                              for p in index.modules if is_under(p, member))
    return sorted(units, key=lambda u: (last[u.path], -u.path.count("."), u.path == ROOT))


def _tied_groups(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return [group for group in names.values() if len(group) > 1]


def _shard_members(units: list[Unit]) -> dict[str, str]:
    """Every module path a shard unit is made of (the root aside) -> that unit's primary
    path; the first unit listing a module keeps it."""
    members: dict[str, str] = {}
    for unit in units:
        if unit.has(Action.SHARD):
            for member in unit.modules:
                if member != ROOT:
                    members.setdefault(member, unit.path)
    return members


def _deepest_member(members: dict[str, str], module_path: str) -> str:
    """Primary path of the deepest shard unit holding ``module_path`` (the unit of its
    nearest ancestor in ``members``, itself included); ROOT if none. One dictionary lookup
    per level, where trying every unit's members for every parameter grew with units x
    parameters."""
    path = module_path
    while path != ROOT:
        if path in members:
            return members[path]
        path = parent_path(path)
    return ROOT


def _resolve_ties(
    index: ModelIndex, units: list[Unit], tied: list[list[str]], group: bool
) -> list[Unit]:
    # Grouping one tied group can split another that was whole (CamemBERT: the bias
    # lm_head.bias = lm_head.decoder.bias is whole at the root until the weight's group
    # pulls lm_head.decoder into the embeddings' unit), so groups are resolved until none
    # is split: the result does not depend on the order the groups are visited in. Each
    # pass merges units, so it ends.
    while True:
        errors = []
        merged = False
        for names in tied:
            members = _shard_members(units)  # again for each group: grouping changes the units
            owners = {n: _deepest_member(members, parent_path(n)) for n in names}
            if len(set(owners.values())) == 1:
                continue
            if not group:
                where = ", ".join(f"{n} in {_label(o)}" for n, o in owners.items())
                errors.append(
                    f"tied parameters are split across shard units: {where}. A tied parameter "
                    "must live in one unit: pass Policy(group_tied=True) to shard these modules "
                    "as one unit, or exclude them from sharding (e.g. rule - by_name(...))."
                )
                continue
            units = _group(units, names, owners)
            merged = True
        if errors:
            raise PlanError("\n".join(errors))
        if not merged:
            return units


def _group(units: list[Unit], names: list[str], owners: dict[str, str]) -> list[Unit]:
    """Merge every unit owning one of ``names`` (and root modules holding them) into the
    first such unit."""
    first = next(o for o in owners.values() if o != ROOT)
    by_path = {u.path: u for u in units}
    keep = by_path[first]
    members = list(keep.modules)
    acts = set(keep.actions)
    reasons = [keep.reason]
    for name, owner in owners.items():
        if owner == ROOT:
            module_path = parent_path(name)
            if module_path == ROOT:
                raise PlanError(
                    f"tied parameter {name} is held by the root module itself, so it cannot "
                    "join a unit: exclude the other holders from sharding."
                )
            if module_path not in members:
                members.append(module_path)
        elif owner != first and owner not in members:
            members += by_path[owner].modules
            acts |= set(by_path[owner].actions)
            reasons.append(by_path[owner].reason)
    merged = dataclasses.replace(
        keep,
        group=tuple(m for m in members if m != keep.path),
        actions=tuple(a for a in Action if a in acts),
        reason="; ".join(reasons) + f"; grouped: tied {' = '.join(names)}",
    )
    absorbed = set(members) - {keep.path}
    return [merged if u.path == first else u for u in units if u.path not in absorbed]


def _split_dtypes(index: ModelIndex, units: list[Unit]) -> list[Unit]:
    """Split every shard unit (the root too) whose trainable parameters have several
    dtypes until none has, where the modules allow it: the unit keeps the dtype of the
    parameters its own module holds directly (else its most bytes' dtype), and each child
    subtree holding trainable parameters of another dtype becomes a shard unit of its own
    (not checkpointed: it runs inside its parent's checkpoint). A child mixing dtypes
    whose own parameters are of another dtype becomes a unit and is split in turn; one
    whose own parameters are the unit's, or a container without a forward (a
    ``ModuleDict``, which no engine can wrap), is looked into. Frozen parameters of
    another dtype stay (FSDP2 and DeepSpeed take them: frozen bfloat16 base weights
    beside float32 LoRA adapters). A module holding two dtypes directly cannot be split:
    the planner's dtype warning says so (docs/design.md, pitfall 57)."""
    while True:
        owned = _ownership(index.model, units)
        shard_paths = [u.path for u in units if u.has(Action.SHARD) and not u.group]
        added: dict[str, str] = {}
        for path in [*shard_paths, ROOT]:
            params = [(n, p) for n, p in owned.get(path, []) if p.requires_grad]
            if len({p.dtype for _, p in params}) < 2:
                continue
            direct = {p.dtype for n, p in params if parent_path(n) == path}
            if len(direct) > 1:
                continue
            keep = next(iter(direct)) if direct else _largest_dtype(params)
            for child in _other_dtype_children(index, path, params, keep):
                added.setdefault(child, f"{_label(path)} keeps its {_dtype_name(keep)} parameters")
        if not added:
            return units
        units = _order_bottom_up(index, units + [
            Unit(path=child, cls=qualified_class_name(index.modules[child]), params=0, bytes={},
                 actions=(Action.SHARD,),
                 reason=f"shard: split_dtypes ({why}; FSDP shards one dtype per unit)")
            for child, why in added.items()])


def _largest_dtype(params: list[tuple[str, nn.Parameter]]) -> torch.dtype:
    sizes: dict[torch.dtype, int] = defaultdict(int)
    for _, p in params:
        sizes[p.dtype] += p.numel() * p.element_size()
    return max(sizes, key=lambda dtype: sizes[dtype])


def _other_dtype_children(index: ModelIndex, path: str, params: list[tuple[str, nn.Parameter]],
                          keep: torch.dtype) -> list[str]:
    """The modules under ``path`` to make units so that the rest of ``params`` (the
    trainable parameters the unit at ``path`` holds) is all ``keep``."""
    by_child: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    for name, param in params:
        module = parent_path(name)
        if module != path:
            rest = module[len(path) + 1:] if path else module
            by_child[f"{path}.{rest.split('.')[0]}" if path else rest.split(".")[0]].append((name, param))
    out: list[str] = []
    for child, child_params in by_child.items():
        dtypes = {p.dtype for _, p in child_params}
        if dtypes == {keep}:
            continue
        direct = {p.dtype for n, p in child_params if parent_path(n) == child}
        wrappable = not isinstance(index.modules[child], (nn.ModuleDict, nn.ModuleList))
        if wrappable and (len(dtypes) == 1 or (len(direct) == 1 and direct != {keep})):
            out.append(child)
        elif not direct or direct == {keep}:
            out += _other_dtype_children(index, child, child_params, keep)
    return out


def unit_parameters(model: nn.Module, plan: Plan) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The parameters each shard unit of ``plan`` holds in ``model`` as it is now (dtypes,
    ``requires_grad``), by the unit's path; ``""`` holds what no unit does. This is how the
    engines group parameters, so their checks read it rather than the Plan's counts, which
    may be older than the model (a Plan made before freezing or casting)."""
    return dict(_ownership(model, [u for u in plan.units if u.has(Action.SHARD)]))


def _ownership(model: nn.Module, units: list[Unit]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """For each shard unit (and ROOT), the distinct parameters it holds. Non-shard units
    get the parameters under them that no nested shard unit holds, for display only."""
    owned: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    members = _shard_members(units)
    other_units = [u for u in units if not u.has(Action.SHARD)]
    for name, param in model.named_parameters():
        module_path = parent_path(name)
        owner = _deepest_member(members, module_path)
        owned[owner].append((name, param))
        for unit in other_units:
            nested_shard_unit = owner != ROOT and is_under(owner, unit.path)
            if any(is_under(module_path, m) for m in unit.modules) and not nested_shard_unit:
                owned[unit.path].append((name, param))
    return owned


def _dtype_warnings(
    index: ModelIndex, units: list[Unit], owned: dict[str, list[tuple[str, nn.Parameter]]]
) -> list[str]:
    """A shard unit holding parameters of several dtypes, and which engines take it: FSDP1
    flattens a unit into one dtype, FSDP2 needs one dtype among a unit's trainable
    parameters, DeepSpeed among all trainable parameters, DDP takes any mix (the engines
    refuse what they cannot do when asked to wrap it: annot/engines/dtypes.py). Frozen and
    trainable parameters may share a unit on every engine (docs/design.md, pitfall 7)."""
    warnings = []
    groups = [(u.path, u.cls) for u in units if u.has(Action.SHARD)]
    groups.append((ROOT, qualified_class_name(index.model)))
    for path, cls in groups:
        params = owned.get(path, [])
        by_dtype = _split(params, lambda p: _dtype_name(p.dtype))
        if len(by_dtype) < 2:
            continue
        trained = _split([(n, p) for n, p in params if p.requires_grad], lambda p: _dtype_name(p.dtype))
        if len(trained) < 2:
            engines = ("FSDP1 flattens a unit into one dtype and refuses it; FSDP2, DeepSpeed and "
                       "DDP train it (its trainable parameters share one dtype)")
        else:
            engines = (f"its trainable parameters are {' and '.join(trained)}: only DDP trains "
                       "that (FSDP2 needs one dtype among a unit's trainable parameters, DeepSpeed "
                       "among all trainable ones, FSDP1 among all of a unit's)")
        warnings.append(
            f"{_label(path)} ({cls.rpartition('.')[2]}) mixes dtypes: {_listing(by_dtype)}. "
            f"{engines}. To shard it anywhere, cast the module to one dtype, or make the odd "
            "parameters' module a unit of its own (by_name(...))")
    return warnings


def _split(params: list[tuple[str, nn.Parameter]], key) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for name, param in params:
        out[key(param)].append(name)
    return out


def _listing(groups: dict[str, list[str]], most: int = 3) -> str:
    parts = []
    for key, names in groups.items():
        shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
        parts.append(f"{key} ({shown})")
    return "; ".join(parts)


def _label(path: str) -> str:
    return f"module `{path}`" if path else "the root (what no unit holds)"


def _with_counts(unit: Unit, params: list[tuple[str, nn.Parameter]], index: ModelIndex) -> Unit:
    return dataclasses.replace(
        unit,
        params=sum(p.numel() for _, p in params),
        bytes=_bytes_by_dtype(p for _, p in params),
        trainable=sum(p.numel() for _, p in params if p.requires_grad),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes_by_dtype(params) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in params:
        name = _dtype_name(p.dtype)
        out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out
