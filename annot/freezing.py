"""`annot.freeze`: stop parts of a model from training, by role or by rule.

Fine-tuning a vision-language model usually leaves the vision tower (and often the
projector) as it was loaded and trains the language model (LLaMA-Factory's and
ms-swift's defaults); a diffusion model's text encoders and VAE are not trained at all.
`freeze` sets ``requires_grad=False`` on every parameter of the parts it is given, before
the model is planned and wrapped, so that:

- no engine gives them an optimizer state or gradient buffers (`auto_wrap`'s optimizer
  factory and `annot.Trainable` receive only parameters that require grad);
- the Plan counts them as frozen and drops the checkpointing of a frozen tower's blocks
  (nothing in them needs a gradient: `annot.policies.planner`);
- `annot.save` still writes them (they are the model's weights).
"""

from __future__ import annotations

from torch import nn

from annot.policies.model_index import ModelIndex
from annot.policies.roles import module_roles
from annot.policies.rules import Rule, by_role

__all__ = ["freeze"]


def freeze(model: nn.Module, *parts: str | Rule) -> list[str]:
    """Freeze every parameter of the modules ``parts`` select: role names
    (`annot.policies.roles`: ``"vision"``, ``"audio"``, ``"projector"``, ``"language"``,
    ``"encoder"``, ``"decoder"``, ...), or rules (``annot.by_name("model.visual.*")``).
    Returns the names of the parameters frozen by this call (each once, in model order).

    Call it before `annot.auto_wrap` (or pass ``freeze=`` to `annot.from_pretrained`),
    on the bare model, built or on the meta device. A role the model does not have, or a
    rule that selects nothing, is a `ValueError` naming what the model has: freezing
    nothing is never silent."""
    if not parts:
        raise ValueError("freeze() needs the parts to freeze: role names such as 'vision' or rules")
    roles = module_roles(model)
    index = ModelIndex(model)
    chosen: list[str] = []
    for part in parts:
        rule = by_role(part) if isinstance(part, str) else part
        if not isinstance(rule, Rule):
            raise TypeError(f"freeze() takes role names or rules, not {type(part).__name__}")
        selected = list(rule.select(index))
        if not selected:
            if isinstance(part, str):
                have = ", ".join(sorted(set(roles.values()))) or "none: it is a model of one part"
                raise ValueError(f"{type(model).__name__} has no part with role {part!r} (its roles: {have})")
            raise ValueError(f"freeze(): rule {rule.name} selects no module of {type(model).__name__}")
        chosen += [path for path in selected if path not in chosen]
    frozen: list[str] = []
    seen: set[int] = set()
    for path in chosen:
        prefix = f"{path}." if path else ""
        for name, param in model.get_submodule(path).named_parameters():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                param.requires_grad_(False)
                frozen.append(prefix + name)
    return frozen
