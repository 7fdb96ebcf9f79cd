"""A Policy says which rule selects the modules for each action.

``Policy(shard=by_class(Block), checkpoint=every_nth(2, by_class(Block)))`` shards every
block and checkpoints every second one. Overrides are applied after, in order, so
``policy.override(by_name("lm_head"), shard=False)`` wins over the rules above it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypedDict

from annot.policies.marks import OFFLOAD_TARGETS, Action
from annot.policies.plan import FLOAT8_RECIPES
from annot.policies.rules import Rule, keep_in_fp32_modules, marked, no_split_modules

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python >= 3.11

__all__ = ["TOWER_MODES", "Override", "Policy"]

#: How `Policy.towers` shards a multimodal model's towers (``None``: as the rules say).
TOWER_MODES = (None, "blocks", "whole")


@dataclasses.dataclass(frozen=True)
class Override:
    """Set (True) or clear (False) actions on what ``rule`` selects; None leaves them."""

    rule: Rule
    shard: bool | None = None
    checkpoint: bool | None = None
    offload: bool | None = None
    float8: bool | None = None
    compile: bool | None = None

    def changes(self) -> dict[Action, bool]:
        return {
            action: value
            for action, value in (
                (Action.SHARD, self.shard),
                (Action.CHECKPOINT, self.checkpoint),
                (Action.OFFLOAD, self.offload),
                (Action.FLOAT8, self.float8),
                (Action.COMPILE, self.compile),
            )
            if value is not None
        }


@dataclasses.dataclass(frozen=True)
class Policy:
    """Rules per action, then overrides.

    ``offload_to`` is the target for offloaded units whose marks do not name one.
    ``group_tied`` puts modules that share a parameter into one shard unit instead of
    rejecting the plan (tied embeddings and heads, as torchtitan groups them).
    ``split_dtypes`` makes a shard unit that holds parameters of several dtypes hold
    only those of its own module's dtype, the children holding others becoming units of
    their own (a model kept partly in float32 by its library, Wan's ``scale_shift_table``
    beside bfloat16 blocks: FSDP shards one dtype per unit; docs/design.md, pitfall 57).
    ``towers`` makes each vision or audio tower of a multimodal model
    (`annot.policies.roles`) a unit, and each projector beside it another: ``"blocks"``
    keeps the tower's blocks units of their own inside it, ``"whole"`` shards the tower as
    one unit (its blocks still checkpointed); ``None`` leaves towers to the rules.
    ``float8`` selects the units whose eligible linears compute in float8
    (`annot.policies.float8` says which linears are eligible) with ``float8_recipe``;
    ``compile`` the units whose forward is compiled (`annot.compiled_blocks`).
    """

    shard: Rule | None = None
    checkpoint: Rule | None = None
    offload: Rule | None = None
    offload_to: str = "cpu"
    group_tied: bool = False
    overrides: tuple[Override, ...] = ()
    split_dtypes: bool = False
    towers: str | None = None
    float8: Rule | None = None
    compile: Rule | None = None
    float8_recipe: str = "tensorwise"

    def __post_init__(self) -> None:
        for action in Action:
            rule = getattr(self, action.value)
            if rule is not None and not isinstance(rule, Rule):
                raise TypeError(f"Policy({action.value}=...) takes a rule, not {type(rule).__name__}")
        if self.offload_to not in OFFLOAD_TARGETS:
            raise ValueError(f"offload_to must be one of {OFFLOAD_TARGETS}, got {self.offload_to!r}")
        if self.towers not in TOWER_MODES:
            raise ValueError(f"towers must be one of {TOWER_MODES}, got {self.towers!r}")
        if self.float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"float8_recipe must be one of {FLOAT8_RECIPES}, got {self.float8_recipe!r}")

    def rules(self) -> dict[Action, Rule]:
        return {a: r for a in Action if (r := getattr(self, a.value)) is not None}

    def override(
        self,
        rule: Rule,
        *,
        shard: bool | None = None,
        checkpoint: bool | None = None,
        offload: bool | None = None,
        float8: bool | None = None,
        compile: bool | None = None,
    ) -> Policy:
        """A copy with one more override (later overrides win)."""
        extra = Override(rule, shard=shard, checkpoint=checkpoint, offload=offload, float8=float8,
                         compile=compile)
        if not extra.changes():
            raise ValueError("override() needs at least one of shard=, checkpoint=, offload=, "
                             "float8=, compile=")
        return dataclasses.replace(self, overrides=(*self.overrides, extra))

    def describe(self) -> str:
        parts = [a.value + (f"({self.float8_recipe})" if a is Action.FLOAT8 else "") + f"={r.name}"
                 for a, r in self.rules().items()]
        parts += [
            f"override({o.rule.name}: "
            + ", ".join(f"{a.value}={v}" for a, v in o.changes().items())
            + ")"
            for o in self.overrides
        ]
        if self.group_tied:
            parts.append("group_tied")
        if self.split_dtypes:
            parts.append("split_dtypes")
        if self.towers is not None:
            parts.append(f"towers={self.towers}")
        return "; ".join(parts) or "(empty)"

    @classmethod
    def from_marks(cls, **options: Unpack[_MarksOptions]) -> Policy:
        """Each action from the marks (`annot.shard_block`, `annot.mark`, ...)."""
        return cls(
            shard=marked(Action.SHARD),
            checkpoint=marked(Action.CHECKPOINT),
            offload=marked(Action.OFFLOAD),
            **options,
        )

    @classmethod
    def from_hf(cls, *, checkpoint: bool = True, group_tied: bool = True,
                **options: Unpack[_HFOptions]) -> Policy:
        """HuggingFace metadata: shard (and by default checkpoint) the `_no_split_modules`.
        Tied embeddings and heads (``tie_word_embeddings``) are grouped into one unit;
        ``_keep_in_fp32_modules`` held in fp32 in a lower-precision model are units of
        their own, and a unit holding parameters of several dtypes is split
        (``split_dtypes``)."""
        blocks = no_split_modules()
        # Modules kept in fp32 inside a bf16/fp16 model become units of their own
        # (selects nothing in an all-fp32 model), so no unit mixes dtypes.
        options.setdefault("split_dtypes", True)
        options.setdefault("towers", "blocks")
        return cls(shard=blocks | keep_in_fp32_modules(),
                   checkpoint=blocks if checkpoint else None,
                   group_tied=group_tied, **options)


class _MarksOptions(TypedDict, total=False):
    """The `Policy` fields `Policy.from_marks` takes as keywords."""

    offload_to: str
    group_tied: bool
    overrides: tuple[Override, ...]


class _HFOptions(TypedDict, total=False):
    """The `Policy` fields `Policy.from_hf` takes as keywords."""

    offload: Rule | None
    offload_to: str
    overrides: tuple[Override, ...]
    split_dtypes: bool
    towers: str | None
