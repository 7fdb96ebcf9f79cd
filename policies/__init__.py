"""policies: decide which modules get sharded, checkpointed, offloaded, and why.

Rules select modules (`by_class`, `by_name`, `by_role`, `by_size`, `every_nth`, `marked`,
`no_split_modules`, `repeated_blocks`, `list_elements`, combined with ``|``, ``&``, ``-``); a `Policy` maps
actions to rules; `make_plan` turns (model, policy) into a validated `Plan`. This package
imports ``torch.nn`` only: never ``torch.distributed``, DeepSpeed, transformers or annot.
"""

from annot.policies.errors import AnnotError, PlanError
from annot.policies.marks import Action, Mark
from annot.policies.parse import parse_rule
from annot.policies.plan import Plan, RootInfo, Unit
from annot.policies.planner import default_policy, make_plan, unit_parameters
from annot.policies.policy import Override, Policy
from annot.policies.rules import (
    Rule,
    by_class,
    by_name,
    by_role,
    by_size,
    every_nth,
    list_elements,
    marked,
    no_split_modules,
    repeated_blocks,
)
from annot.policies.tensor_parallel import TensorParallelRule, tp_rule

__all__ = [
    "Action",
    "AnnotError",
    "Mark",
    "Override",
    "Plan",
    "PlanError",
    "Policy",
    "RootInfo",
    "Rule",
    "TensorParallelRule",
    "Unit",
    "by_class",
    "by_name",
    "by_role",
    "by_size",
    "default_policy",
    "every_nth",
    "list_elements",
    "make_plan",
    "marked",
    "no_split_modules",
    "parse_rule",
    "repeated_blocks",
    "tp_rule",
    "unit_parameters",
]
