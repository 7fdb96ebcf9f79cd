"""DeepSpeed ZeRO driven by a Plan.

The order of steps:
1. ``deepspeed.checkpointing.configure`` with the config, without which DeepSpeed ignores
   the config's ``activation_checkpointing`` section (docs/design.md, pitfall 9);
2. checkpoint the Plan's modules at run time with DeepSpeed's checkpoint, so partitioned
   and CPU activation checkpoints apply (module names unchanged, as with torch engines);
3. mark ZeRO-3 leaf modules (``leaf_modules``, e.g. MoE blocks, whose experts run in a
   different order each step): ZeRO-3 then gathers a leaf's parameters all at once when
   the leaf is entered instead of hooking its submodules, which must happen before
   ``deepspeed.initialize`` installs those hooks;
4. a model built under `annot.meta_init` gets its values: with ZeRO-3 each unit is
   allocated and partitioned in turn (``deepspeed.zero.Init(module=unit)``), then the
   partitions are filled from the construction record; before ``initialize``, which
   copies the values into the optimizer's master weights;
5. ``deepspeed.initialize``: ZeRO partitions what the stage says, then builds the
   optimizer from the parameters it now manages. The optimizer is a factory called by
   DeepSpeed, so it cannot be built on the parameters before partitioning.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from annot.meta.unit_allocation import UnitAllocator, module_tensors
from annot.runtime.activation_checkpoint import apply_checkpointing
from annot.checkpoint_io.loading import load_logged
from annot.meta.materialization import materialize
from annot.policies import Rule
from annot.policies.model_index import ModelIndex

__all__ = [
    "LeafModules",
    "apply_deepspeed",
    "deepspeed_checkpoint",
    "partition_unit_by_unit",
    "set_leaf_modules",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# Classes (or class names, as DeepSpeed takes them) or a rule selecting module instances.
LeafModules = Rule | Sequence[type[nn.Module] | str]


def deepspeed_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.checkpointing.checkpoint`` with the output's shape kept.

    DeepSpeed's checkpoint is reentrant (the gradient flows only if an input tensor
    requires grad, as a block's hidden state does) and returns a bare tensor where the
    function returned a 1-tuple (docs/design.md, pitfall 9); the 1-tuple is restored here, and a
    call whose inputs need no gradient (positional or keyword) is not checkpointed.
    """
    import deepspeed

    if torch.is_grad_enabled() and not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        # Reentrant checkpointing cuts the graph when no input requires grad (an embeddings
        # unit fed token ids or pixels): its parameters, and every parameter before the
        # next such unit, would silently get no gradient. Such a unit runs plainly.
        return function(*args, **kwargs)
    one_tuple = False

    def run(*a: Any, **k: Any) -> Any:
        nonlocal one_tuple
        out = function(*a, **k)
        one_tuple = isinstance(out, tuple) and len(out) == 1
        return out

    out = deepspeed.checkpointing.checkpoint(run, *args, **kwargs)
    return (out,) if one_tuple else out


def set_leaf_modules(model: nn.Module, leaf_modules: LeafModules) -> list[str]:
    """Mark the modules ``leaf_modules`` selects as ZeRO-3 leaves; returns their paths.

    Classes and class names go to ``deepspeed.utils.set_z3_leaf_modules`` (instances of a
    class and of its subclasses); a rule (``annot.by_name("*.experts")``) marks exactly the
    module instances it selects. Selecting nothing is a `ValueError`.
    """
    from deepspeed.utils import set_z3_leaf_module, set_z3_leaf_modules

    if isinstance(leaf_modules, Rule):
        paths = list(leaf_modules.select(ModelIndex(model)))
        for path in paths:
            set_z3_leaf_module(model.get_submodule(path), True)
    else:
        if isinstance(leaf_modules, (str, type)):
            leaf_modules = [leaf_modules]
        chosen = {id(m) for m in set_z3_leaf_modules(model, list(leaf_modules), raise_if_not_found=False)}
        paths = [path for path, m in model.named_modules() if id(m) in chosen]
    if not paths:
        raise ValueError(
            f"leaf_modules={leaf_modules!r} selects no module of {type(model).__name__}: "
            "pass the MoE block's class (or its name), or a rule such as by_name('*.moe')"
        )
    return paths


def apply_deepspeed(
    model: nn.Module,
    *,
    checkpoint_paths: Sequence[str],
    config: dict[str, Any],
    optimizer: OptimizerFactory,
    leaf_modules: LeafModules | None = None,
    unit_paths: Sequence[str] = (),
    device: torch.device | None = None,
    load_from: str | os.PathLike[str] | None = None,
) -> Any:
    """Configure checkpointing, checkpoint ``checkpoint_paths``, mark ``leaf_modules`` as
    ZeRO-3 leaves (ZeRO stage 3 only), and return the ``DeepSpeedEngine`` from
    ``deepspeed.initialize`` (its ``.module`` is ``model``).

    A model built under `annot.meta_init` is materialized before ``initialize`` (which
    copies the values into the optimizer's master weights): with ZeRO-3 one unit of
    ``unit_paths`` at a time (`partition_unit_by_unit`), so each rank holds its
    partitions plus about one unit; with ZeRO-1/2, which keep whole parameters on every
    rank, and with parameters offloaded to NVMe, all at once on ``device``. With
    ``load_from`` its values are loaded from that checkpoint instead (`annot.load`: each
    ZeRO-3 rank reads the rows its partitions cover)."""
    import deepspeed
    import torch.distributed as dist

    stage = config.get("zero_optimization", {}).get("stage", 0)
    if leaf_modules is not None and stage != 3:
        raise ValueError(
            f"leaf_modules is a ZeRO-3 setting, but the config's ZeRO stage is {stage}: "
            "use stage 3 (auto_wrap's reshard_after_forward=True) or drop leaf_modules"
        )
    # DeepSpeed keeps its own communication backend; it wraps the process group torch
    # already has, and `configure` below needs it before `initialize` would set it up.
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    if checkpoint_paths:
        deepspeed.checkpointing.configure(None, deepspeed_config=config)
    apply_checkpointing(model, checkpoint_paths, deepspeed_checkpoint)
    if leaf_modules is not None:
        set_leaf_modules(model, leaf_modules)
    if any(t.is_meta for t in module_tensors(model)):
        if stage == 3 and not _params_swapped_to_nvme(config):
            partition_unit_by_unit(model, unit_paths, config, device or torch.device("cpu"))
        if load_from is not None:
            load_logged(model, load_from, device)
        else:
            materialize(model, device=device)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config
    )
    return engine


def _params_swapped_to_nvme(config: dict[str, Any]) -> bool:
    """Whether ZeRO-3 swaps parameter partitions out to NVMe. Their ``ds_tensor`` is then
    on disk, not in memory, so the partitions cannot be filled in place after
    `partition_unit_by_unit`: such a model is materialized whole and partitioned by
    ``initialize`` instead (transient: the full model on every rank)."""
    offload = config.get("zero_optimization", {}).get("offload_param") or {}
    return offload.get("device") == "nvme"


def partition_unit_by_unit(model: nn.Module, unit_paths: Sequence[str], config: dict[str, Any],
                           device: torch.device) -> None:
    """ZeRO-3-partition a meta ``model`` one shard unit at a time: give a unit's tensors
    storage (values undefined), then ``deepspeed.zero.Init(module=unit)`` partitions its
    parameters at once and frees the full ones; deepest units first, the root's own
    parameters last. `annot.materialize` then fills each rank's partitions."""
    import deepspeed

    allocator = UnitAllocator(model, device)
    # Deepest first, so a unit nested in another is partitioned before its parent
    # allocates; "" (the root) takes whatever is left. Plan order otherwise, identical on
    # every rank: each zero.Init call is collective and numbers the parameters (ds_id).
    paths = [p for p in dict.fromkeys(unit_paths) if p]
    for path in sorted(paths, key=lambda p: -p.count(".")) + [""]:
        unit = model.get_submodule(path)
        for module in unit.modules():
            allocator(module)
        deepspeed.zero.Init(module=unit, config_dict_or_path=config)
    allocator.record_on(model)
