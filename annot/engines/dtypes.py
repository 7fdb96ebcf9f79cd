"""Which mixes of parameter dtypes each engine can shard; each engine's `check` refuses
the rest before anything changes, naming the engine, the modules and the fix.

What decides it (torch 2.13, DeepSpeed 0.19; docs/design.md, pitfall 7):

- FSDP2: per unit, one dtype among the parameters that require grad. At the first
  forward ``FSDPParamGroup._init_mp_dtypes`` asserts one original dtype and one reduce
  dtype over the unit's trainable parameters only, and reduce-scatter asserts one gradient
  dtype (``foreach_reduce``). Frozen parameters may have any dtype: the all-gather falls
  back to bytes when its inputs' dtypes differ (``_get_all_gather_input_metadatas``). A
  ``MixedPrecisionPolicy`` changes nothing here (its dtypes are per unit, so equal
  original dtypes give equal reduce dtypes).
- FSDP1: per unit, one dtype over every parameter, frozen ones included: a unit is one
  ``FlatParameter`` (``FlatParamHandle._validate_tensors_to_flatten``: "Must flatten
  tensors with uniform dtype"), with ``use_orig_params`` or without.
- DeepSpeed ZeRO: one dtype among all trainable parameters of the model, whatever the
  units: its optimizer keeps them in flat buffers of one dtype (stages 1-2 flatten each
  parameter group with one cat and size it, and the optimizer's ``self.dtype``, by the
  first trainable parameter; stage 3's ``defragment`` asserts one dtype over all
  trainable partitions). Frozen parameters stay outside those buffers; ZeRO-3 gathers
  them per dtype (``_all_gather_coalesced``). Checked without a bf16/fp16 config; with
  one, DeepSpeed casts every parameter to it at ``initialize``.
- DDP: any mix (its buckets are per dtype); nothing to refuse.

Which parameters are trainable is read when `auto_wrap` runs. Unfreezing a parameter of
another dtype afterwards is not silent on FSDP2: torch raises at the first forward if it
has not run yet ("FSDP expects uniform original parameter dtype"), else at the backward
("FSDP reduce-scatter expects uniform gradient dtype"; with a mixed-precision policy, a
gradient of the wrong dtype). Measured with torch 2.13 on one rank.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from annot.errors import EngineNotAvailableError
from annot.policies import Plan, unit_parameters

__all__ = ["refuse_deepspeed_dtypes", "refuse_fsdp1_dtypes", "refuse_fsdp2_dtypes"]

_UNIT_FIX = ("give the odd parameters' module a unit of its own "
             "(Policy(shard=... | by_name(...)))")


def refuse_fsdp2_dtypes(model: nn.Module, plan: Plan) -> None:
    """FSDP2 takes a unit whose trainable parameters share one dtype; frozen ones may differ
    (a LoRA adapter in fp32 beside frozen bf16 base weights)."""
    mixed = _mixed_units(model, plan, trainable_only=True)
    if mixed:
        raise EngineNotAvailableError(
            f"fsdp2 needs one dtype among the trainable parameters of each unit (torch asserts "
            f"it at the first forward), but {'; '.join(mixed)}: cast the trainable ones to one "
            f"dtype, freeze the odd ones, or {_UNIT_FIX}. Frozen parameters may keep another "
            "dtype")


def refuse_fsdp1_dtypes(model: nn.Module, plan: Plan) -> None:
    """FSDP1 takes a unit whose parameters, frozen or not, share one dtype."""
    mixed = _mixed_units(model, plan, trainable_only=False)
    if mixed:
        raise EngineNotAvailableError(
            f"fsdp1 flattens each unit into one FlatParameter of one dtype, frozen parameters "
            f"included, but {'; '.join(mixed)}: cast the unit to one dtype, or {_UNIT_FIX}, or use "
            "engine='fsdp2' (it needs one dtype only among a unit's trainable parameters) or "
            "engine='ddp'")


def refuse_deepspeed_dtypes(model: nn.Module) -> None:
    """DeepSpeed takes a model whose trainable parameters share one dtype; frozen ones may
    differ."""
    by_dtype = _names_by_dtype((n, p) for n, p in model.named_parameters() if p.requires_grad)
    if len(by_dtype) > 1:
        raise EngineNotAvailableError(
            f"deepspeed keeps all trainable parameters in flat buffers of one dtype, but "
            f"{type(model).__name__} trains {_listing(by_dtype)}: cast the trainable parameters "
            "to one dtype or freeze the odd ones (frozen parameters may keep another dtype), "
            "or use engine='fsdp2', which needs one dtype only within each unit")


def _mixed_units(model: nn.Module, plan: Plan, trainable_only: bool) -> list[str]:
    """One line per shard unit (or the root) holding several dtypes, among its trainable
    parameters or all of them."""
    out = []
    for path, params in unit_parameters(model, plan).items():
        chosen = [(n, p) for n, p in params if p.requires_grad or not trainable_only]
        by_dtype = _names_by_dtype(chosen)
        if len(by_dtype) > 1:
            where = f"module `{path}`" if path else "the root (what no unit holds)"
            verb = "trains" if trainable_only else "holds"
            out.append(f"{where} {verb} {_listing(by_dtype)}")
    return out


def _names_by_dtype(params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, param in params:
        out.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    return out


def _listing(by_dtype: dict[str, list[str]], most: int = 2) -> str:
    parts = []
    for dtype, names in by_dtype.items():
        more = f" and {len(names) - most} more" if len(names) > most else ""
        parts.append(f"{dtype} ({', '.join(names[:most])}{more})")
    return " and ".join(parts)
