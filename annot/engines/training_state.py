"""A trainable's model and optimizer state in one checkpoint layout, for every engine.

The layout is torch's own for distributed checkpoints (DCP): ``model.<name>`` for every
parameter and persistent buffer, ``optim.state.<name>.<key>`` for the optimizer state
of each trained parameter (``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW), names as
in the bare model, tensors in their real shapes. Each rank contributes the pieces it
holds (DCP chunks) and reads the pieces it keeps, so a state saved on N ranks by one
engine loads on M ranks into another. The optimizer's hyperparameters (param groups)
are returned as JSON-able data, kept out of DCP's pickled objects.

- FSDP2, DDP: torch's ``get_state_dict`` / ``set_state_dict``
  (``torch.distributed.checkpoint.state_dict``), which already give this layout
  (FSDP2: the DTensor row shards themselves; DDP: whole tensors, written once).
- FSDP1 (``use_orig_params=True``): each original parameter, and its optimizer state,
  is the 1-D part of it in this rank's flat shard, described as `FlatChunks` of the
  real shape (`FlatState`). torch's ``get_state_dict`` for FSDP1 gathers every unit's
  optimizer state and re-chunks it: measured on 2 ranks, a save peaked at 2.2 MB of a
  2.5 MB whole model and optimizer state; this way it stays at this rank's part.
- DeepSpeed ZeRO 1-3: `annot.engines.deepspeed_state`, which describes ZeRO's flat fp32
  partitions and optimizer state as chunks of the same tensors.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from annot.checkpoint_io.flat_chunks import FlatChunks
from annot.checkpoint_io.loading import state_names
from annot.engines.base import EngineState, Reader, Trainable
from annot.errors import CheckpointError
from annot.meta.layout import ShardLayout
from annot.quantized_tensors import is_quantized

__all__ = [
    "EngineState", "FlatState", "Reader", "TorchState", "groups_from_json", "groups_to_json",
    "init_optimizer_state",
]


class TorchState:
    """FSDP2, FSDP1, DDP (and a plain module): torch's distributed state-dict API."""

    def __init__(self, trainable: Trainable) -> None:
        self.module = trainable.module
        self.optimizer = trainable.optimizer

    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return ({"model": _without_quantized(model_sd), "optim": {"state": optim_sd["state"]}},
                groups_to_json(cast("list[dict[str, Any]]", optim_sd["param_groups"])), {})

    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        # get_state_dict creates the optimizer's state if it has none yet (a step with
        # zero gradients and lr 0), so there is something to read into.
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        before = len(model_sd)
        optim_sd["param_groups"] = groups_from_json(
            param_groups, cast("list[dict[str, Any]]", optim_sd["param_groups"]))
        model_sd = _without_quantized(model_sd)
        read({"model": model_sd, "optim": {"state": optim_sd["state"]}})
        # A quantized base is left out (it is rebuilt from its checkpoint): not strict.
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd,
                       optim_state_dict=optim_sd,
                       options=StateDictOptions(strict=len(model_sd) == before))


def _without_quantized(model_sd: dict[str, Any]) -> dict[str, Any]:
    """``model_sd`` less its quantized weights (a QLoRA base, `annot.quantization`): the
    frozen base is rebuilt from its own checkpoint on resume, and DCP cannot load into
    the packed tensor type (docs/design.md, pitfall 67); `annot.training_state` records
    their settings and checks them."""
    return {name: value for name, value in model_sd.items() if not is_quantized(value)}


class FlatState:
    """An engine whose parameters are this rank's flat ranges of the real ones (FSDP1
    with ``use_orig_params=True``: 1-D views into its flat shard, `ShardLayout`) and
    whose torch optimizer steps those same views (its state is shaped like them)."""

    def __init__(self, trainable: Trainable, layout: ShardLayout) -> None:
        self.module = trainable.module
        self.optimizer = trainable.optimizer
        self.layout = layout
        self.names = {id(t): n for n, t in reversed(state_names(self.module, layout).items())}

    def _value(self, tensor: torch.Tensor, local: torch.Tensor) -> Any:
        """``local`` (``tensor`` or its optimizer state) as the real tensor's chunks."""
        parts = self.layout.parts.get(id(tensor))
        if not parts:  # whole on every rank
            return local
        part = parts[0]
        return FlatChunks(part.full_shape, local.dtype, [(part.start, part.stop, local.view(-1))])

    def _state(self) -> dict[str, dict[str, Any]]:
        state: dict[str, dict[str, Any]] = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                entries = self.optimizer.state.get(param, {})
                state[self.names[id(param)]] = {
                    key: value if value.dim() == 0 else self._value(param, value)
                    for key, value in entries.items() if isinstance(value, torch.Tensor)}
        return state

    def _model(self) -> dict[str, Any]:
        return {name: self._value(t, t.data) for name, t in state_names(self.module, self.layout).items()}

    def _groups(self) -> list[dict[str, Any]]:
        return [{**group, "params": [self.names[id(p)] for p in group["params"]]}
                for group in self.optimizer.param_groups]

    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        return ({"model": self._model(), "optim": {"state": self._state()}},
                groups_to_json(self._groups()), {})

    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        groups = groups_from_json(param_groups, self._groups())
        init_optimizer_state(self.optimizer)
        with torch.no_grad():
            read({"model": self._model(), "optim": {"state": self._state()}})
        for group, loaded in zip(self.optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a torch optimizer that has not stepped its state, so a checkpoint can be
    read into it: one step with zero gradients and learning rate 0 (as torch's
    ``get_state_dict`` does), which leaves the parameters as they are. A parameter with
    no elements here (a flat shard holding none of it) gets no state, as in a run that
    trained: it never has a gradient on this rank, so its state would never advance,
    and its stale ``step`` would be saved beside the advancing one of the rank that
    holds it (DCP keeps one of the two)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.requires_grad and p.numel() > 0]
    if any(p.grad is not None for p in params):
        raise CheckpointError("load the training state before the first backward: the "
                              "optimizer has gradients but no state yet")
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_to_json(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"optimizer param group {where} holds {type(value).__name__}, which a "
                          "training-state checkpoint cannot keep (numbers, strings, lists only)")


def groups_to_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups (``params`` already names) as JSON-able data."""
    return [{k: _to_json(v, f"{i} {k!r}") for k, v in group.items()} for i, group in enumerate(groups)]


def groups_from_json(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``current`` (whose ``params`` are this optimizer's) with the saved hyperparameters,
    typed as the current ones are (tuples, tensors). Groups must hold the same names."""
    if len(saved) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one "
                              f"{len(current)}: build the optimizer with the same groups")
    out = []
    for i, (old, new) in enumerate(zip(saved, current, strict=True)):
        if sorted(old.get("params", [])) != sorted(new["params"]):
            lost = sorted(set(old.get("params", [])) ^ set(new["params"]))
            raise CheckpointError(
                f"optimizer param group {i} trains other parameters than the checkpoint's "
                f"({', '.join(lost[:6])}{' ...' if len(lost) > 6 else ''} differ): freeze and "
                "group parameters as in the run that saved it")
        group = dict(new)
        for key, value in old.items():
            if key == "params":
                continue
            like = new.get(key)
            if isinstance(like, tuple):
                value = tuple(value)
            elif isinstance(like, torch.Tensor):
                value = torch.tensor(value, dtype=like.dtype, device=like.device)
            group[key] = value
        out.append(group)
    return out
