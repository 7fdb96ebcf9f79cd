"""The Plan as a policy another tool evaluates on the module it hands over.

Tools that take a wrap or checkpointing policy (torch's FSDP1 and
``apply_activation_checkpointing``, Lightning's ``FSDPStrategy``) call it on *their*
module tree: a deepcopy, the model a ``LightningModule`` builds in ``configure_model``, a
tree FSDP1 has already wrapped. So `PlanPolicy` never remembers modules it saw earlier
(no ``id()``): it resolves the Plan's paths and classes on the root the tool gives it
(docs/design.md, pitfall 15). The Plan may be made for the whole tree or for a part of it
(the user's model inside a ``LightningModule``): the Plan's tree is found wherever its
root class and every unit's path and class match. A Plan that matches nothing there, or
a selection that should hold modules and comes out empty, is an error, never silence
(pitfall 8).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import _Policy

from annot.errors import PolicySelectionError
from annot.huggingface.model import prepare_for_training
from annot.policies import Plan
from annot.policies.model_index import qualified_class_name

__all__ = ["PlanPolicy", "PolicySelectionError", "locate_plan", "plain_path"]

# Module names tools insert above a module they wrap; no path of the bare model has them
# (FSDP1, torch's checkpoint_wrapper, torch.compile).
WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def plain_path(name: str) -> str:
    """``name`` without the levels wrappers insert (``_fsdp_wrapped_module`` ...)."""
    return ".".join(part for part in name.split(".") if part and part not in WRAPPER_NAMES)


def _by_plain_path(root: nn.Module, ignored: set[nn.Module]) -> dict[str, list[nn.Module]]:
    found: dict[str, list[nn.Module]] = {}
    for name, module in root.named_modules():
        if module not in ignored:
            found.setdefault(plain_path(name), []).append(module)
    return found


def _join(prefix: str, path: str) -> str:
    return ".".join(p for p in (prefix, path) if p)


def _of_class(modules: list[nn.Module], cls: str) -> nn.Module | None:
    """The innermost of the modules at one path (a wrapper and what it wraps) whose class
    is ``cls`` (qualified, as a Plan's units name it, or bare, as a Plan names its model)."""
    for module in reversed(modules):
        if cls in (qualified_class_name(module), type(module).__name__):
            return module
    return None


def locate_plan(root: nn.Module, plan: Plan, ignored: set[nn.Module] | None = None) -> list[str]:
    """Where ``plan``'s model sits in ``root``: the path prefixes (``""``: ``root`` is it)
    under which the Plan's root class and every unit's modules, with their classes, are
    found. Raises `PolicySelectionError` when there is none."""
    return _locate(_by_plain_path(root, ignored or set()), root, plan)


def _locate(by_path: dict[str, list[nn.Module]], root: nn.Module, plan: Plan) -> list[str]:
    """`locate_plan` on ``root``'s modules already indexed by plain path."""
    expected = [(path, unit.cls) for unit in plan.units for path in unit.modules]
    # Group members of a unit are other classes than unit.cls (tied embedding and head):
    # only the unit's own path is checked by class, the rest by existence.
    own = {unit.path for unit in plan.units}

    def fits(prefix: str) -> bool:
        if _of_class(by_path.get(prefix, []), plan.model) is None:
            return False
        for path, cls in expected:
            modules = by_path.get(_join(prefix, path))
            if not modules or (path in own and _of_class(modules, cls) is None):
                return False
        return True

    prefixes = [p for p in by_path if fits(p)]
    if not prefixes:
        raise PolicySelectionError(
            f"the Plan for {plan.model} matches nothing in the {type(root).__name__} this "
            f"policy was given: no {plan.model} module there has the Plan's units "
            f"({', '.join(u.path for u in plan.units[:3])}{' ...' if len(plan.units) > 3 else ''}). "
            "Make the policy from the same model class (annot.fsdp1_policies(model) with "
            "the model your LightningModule builds), or pass the Plan of the whole module")
    return prefixes


class PlanPolicy(_Policy):
    """A torch wrap policy (``_Policy``) selecting the Plan's modules at ``paths`` on the
    root module the tool passes to ``_run_policy``, by path and class.

    ``paths`` are module paths of the Plan's model. An empty ``paths`` selects nothing by
    request (``checkpoint=False``); a non-empty one that finds nothing raises.
    ``no_cache_when_selected``: a checkpointing policy; when it selects something and the
    tree holds a transformers model, that model's training forwards run with
    ``use_cache=False`` (docs/design.md, pitfall 14).
    """

    def __init__(self, plan: Plan, paths: Sequence[str], *, role: str,
                 no_cache_when_selected: bool = False) -> None:
        self.plan = plan
        self.paths = tuple(paths)
        self.role = role
        self.no_cache_when_selected = no_cache_when_selected

    def select(self, root: nn.Module, ignored: set[nn.Module] | None = None) -> list[nn.Module]:
        """The modules this policy picks in ``root``, in the Plan's order."""
        if not self.paths:
            return []
        ignored = ignored or set()
        by_path = _by_plain_path(root, ignored)
        classes = {path: unit.cls for unit in self.plan.units for path in unit.modules}
        chosen: list[nn.Module] = []
        for prefix in _locate(by_path, root, self.plan):
            for path in self.paths:
                modules = by_path.get(_join(prefix, path), [])
                module = _of_class(modules, classes.get(path, "")) or (modules[-1] if modules else None)
                if module is not None and module not in chosen:
                    chosen.append(module)
        if not chosen:
            raise PolicySelectionError(
                f"the {self.role} policy for {self.plan.model} selects nothing in the "
                f"{type(root).__name__} it was given (expected {', '.join(self.paths[:3])}"
                f"{' ...' if len(self.paths) > 3 else ''})")
        return chosen

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        chosen = self.select(root_module, ignored_modules)
        if chosen and self.no_cache_when_selected:
            prepare_for_training(root_module, checkpointing=True)
        return {module: copy.copy(root_kwargs) for module in chosen}

    def __repr__(self) -> str:
        return f"PlanPolicy({self.role}: {', '.join(self.paths) or 'nothing'} of {self.plan.model})"
