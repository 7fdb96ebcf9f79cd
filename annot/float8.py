"""Float8 training of a Plan's float8 units, through torchao.

`apply_float8` is what `annot.auto_wrap` does to a Plan's float8 units (`Action.FLOAT8`)
before the engine wraps the model: each eligible linear of those units
(`annot.policies.speed.float8_linears`) becomes torchao's ``Float8Linear`` with its
unit's recipe. The module keeps its parameters (``weight`` and ``bias``, the same
tensors), so state-dict keys, checkpoints and optimizers see the bare model's; only the
matmuls change: inputs, weights and output gradients are cast to float8 with dynamic
scales (one per tensor, or one per row) and multiplied by ``torch._scaled_mm``, which
has CPU and GPU kernels.

Float8 all-gather (FSDP2, tensorwise recipe only): each weight's shard is cast to
float8 before FSDP2 gathers it, so the all-gather moves a quarter of float32's bytes
and half of bfloat16's. Its scale needs the amax of the whole weight; computed at
each gather it costs one all-reduce per weight, precomputed after the optimizer step
(`refresh_float8_scales`, which ``Trainable.step`` runs) one for all of them.

Every engine trains the converted model: FSDP2, FSDP1, DDP and DeepSpeed ZeRO-1/2/3 see
plain parameters (tested on 2 gloo ranks against one process). What cannot work is
refused by name before anything changes (`refuse_float8`): float8 all-gather off FSDP2
or with a rowwise recipe, a quantized base, the MX formats. One trap is avoided instead: on gloo a shard unit whose every
parameter would be gathered in float8 fails ("Invalid scalar type": gloo has no float8
type), so those units' linears are gathered in their own dtype, and the log says which
(docs/design.md, pitfall 70).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from annot.policies import Action, Plan
from annot.policies.plan import FLOAT8_RECIPES
from annot.policies.planner import unit_parameters
from annot.policies.speed import Float8Linears, float8_linears
from annot.quantization import import_torchao

__all__ = ["apply_float8", "as_gathered_in_float8", "float8_config", "has_float8_all_gather",
           "refresh_float8_scales", "refuse_float8", "scale_refresher", "torchao_float8"]

_log = logging.getLogger("annot")


def torchao_float8() -> Any:
    """torchao's ``float8`` module; `ImportError` naming the extra when torchao is missing."""
    return import_torchao("torchao.float8", extra="float8", asked="float8 training")


def float8_config(recipe: str, *, all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (`FLOAT8_RECIPES`), with float8
    all-gather on or off (tensorwise only)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather) if all_gather else config


def refuse_float8(plan: Plan, model: nn.Module, engine: str, *, all_gather: bool | None) -> None:
    """Raise ``ValueError`` for a float8 Plan the ``engine`` cannot train, before anything
    is changed. ``all_gather``: float8 all-gather as asked (``None``:
    the default, on where it is correct)."""
    units = [u for u in plan.units if u.has(Action.FLOAT8)]
    if not units:
        if all_gather:
            raise ValueError("float8_all_gather=True: the Plan has no float8 unit (pass float8=RECIPE)")
        return
    missing = [u.path for u in units if u.float8_recipe is None]
    if missing:
        raise ValueError(f"the Plan's float8 units {', '.join(missing)} name no recipe (a Plan edited by "
                         f"hand?): pass float8=RECIPE, one of {', '.join(FLOAT8_RECIPES)}")
    recipes = {str(u.float8_recipe) for u in units}
    if all_gather and engine not in ("fsdp2", "fully_shard"):
        raise ValueError(f"float8_all_gather=True: only FSDP2 gathers weights in float8; engine "
                         f"{engine!r} gathers (or holds) them in their own dtype")
    if all_gather and recipes != {"tensorwise"}:
        raise ValueError(f"float8_all_gather=True with the {', '.join(sorted(recipes - {'tensorwise'}))} "
                         "recipe: a row-wise scale of the weight differs between its use in forward and "
                         "in backward (rows of W and of W transposed), so one float8 copy cannot be "
                         "gathered for both; only the tensorwise recipe gathers in float8")
    quantized = [n for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"
                 or type(getattr(p, "data", None)).__name__ == "NF4Tensor"]
    if quantized:
        raise ValueError(f"float8 with a quantized base ({quantized[0]} is NF4): a quantized weight "
                         "is dequantized by its own linear, which float8 would replace; train the "
                         "LoRA adapters of a quantized base in the model's dtype (leave float8 off)")


def default_all_gather(plan: Plan, engine: str, asked: bool | None) -> bool:
    """Whether FSDP2 gathers the float8 weights in float8: as asked, else on where it is
    correct (FSDP2, every float8 unit tensorwise)."""
    if asked is not None:
        return asked
    recipes = {u.float8_recipe for u in plan.units if u.has(Action.FLOAT8)}
    return engine in ("fsdp2", "fully_shard") and recipes == {"tensorwise"}


def apply_float8(model: nn.Module, plan: Plan, *, all_gather: bool = False, log: bool = True) -> Float8Linears:
    """Convert the eligible linears of ``plan``'s float8 units to torchao's
    ``Float8Linear`` with their unit's recipe, in place (see the module docstring);
    returns which were converted, and logs it with ``log``. Call `refuse_float8` first."""
    chosen = float8_linears(model, plan.units)
    if not chosen.paths:
        return chosen
    float8 = torchao_float8()
    gathered_whole = _all_float8_units(model, plan, chosen) if all_gather and _on_gloo() else set()
    if gathered_whole:
        _log.info("float8 all-gather off for %s: every parameter of %s would be gathered in float8, "
                  "which gloo cannot send (docs/design.md, pitfall 70); gathered in their own dtype",
                  ", ".join(sorted(gathered_whole)), "that unit" if len(gathered_whole) == 1 else "those units")
    recipe_of = {u.path: u.float8_recipe for u in plan.units if u.has(Action.FLOAT8)}
    configs: dict[tuple[str, bool], Any] = {}
    for unit, paths in chosen.chosen.items():
        recipe = recipe_of[unit]
        assert recipe is not None
        key = (recipe, all_gather and unit not in gathered_whole)
        if key not in configs:
            configs[key] = float8_config(recipe, all_gather=key[1])
        for path in paths:
            _swap(model, path, float8.float8_linear.Float8Linear.from_float(model.get_submodule(path),
                                                                            config=configs[key]))
    if log:
        _log.info("%s", chosen.describe())
    return chosen


def _swap(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _on_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def _all_float8_units(model: nn.Module, plan: Plan, chosen: Float8Linears) -> set[str]:
    """The shard units (by path) each of whose parameters is a weight of a converted
    linear: FSDP2 would gather them in one float8 buffer."""
    weights = {id(model.get_submodule(path).weight) for path in chosen.paths}
    owned = unit_parameters(model, plan)
    return {path for path, params in owned.items()
            if path and params and all(id(p) in weights for _, p in params)}


def as_gathered_in_float8(model: nn.Module) -> None:
    """Give each float8 linear of ``model`` the weight FSDP2's float8 all-gather hands its
    forward and backward: one float8 tensor (torchao's ``Float8TrainingTensor``, a scale
    beside the bytes) made once, instead of a cast of the weight at every matmul. For the
    planner's trace of an FSDP2 step (`annot.memory.activations`), in place: that tensor
    is the gathered parameter, priced as such, and the trace never casts a weight."""
    float8 = torchao_float8()
    role = float8.float8_training_tensor.GemmInputRole.WEIGHT
    for module in model.modules():
        if isinstance(module, float8.float8_linear.Float8Linear):
            weight = module.weight
            gathered = float8.float8_scaling_utils.hp_tensor_to_float8_dynamic(
                weight.detach(), module.config.cast_config_weight.target_dtype, module.linear_mm_config,
                gemm_input_role=role)
            module.weight = nn.Parameter(gathered, requires_grad=weight.requires_grad)


def has_float8_all_gather(model: nn.Module) -> bool:
    """Whether some float8 linear of ``model`` gathers its weight in float8."""
    return any(type(m).__name__ == "Float8Linear" and getattr(m.config, "enable_fsdp_float8_all_gather", False)
               for m in model.modules())


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step, compute the float8 scales of every weight FSDP2 gathers in
    float8 with one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``);
    without it each gather computes its weight's scale with an all-reduce of its own. The
    scales are the same either way. ``Trainable.step`` calls it; a loop stepping its own
    optimizer may call it after ``optimizer.step()``. Does nothing for a model without
    float8 all-gather."""
    refresh = scale_refresher(model)
    if refresh is not None:
        refresh()


def scale_refresher(model: nn.Module) -> Callable[[], None] | None:
    """`refresh_float8_scales` of ``model`` with the model's linears looked at once, here,
    not at every step: what ``Trainable.step`` runs after the optimizer; ``None`` for a
    model without float8 all-gather."""
    if not has_float8_all_gather(model):
        return None
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    return lambda: precompute(model)
