"""A trainable's model and optimizer state in one checkpoint layout, for every engine.

The layout is torch's own for distributed checkpoints (DCP): ``model.<name>`` for every
parameter and persistent buffer, ``optim.state.<name>.<key>`` for the optimizer state
of each trained parameter (``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW), names as
in the bare model, tensors in their real shapes. Each rank contributes the pieces it
holds (DCP chunks) and reads the pieces it keeps, so a state saved on N ranks by one
engine loads on M ranks into another. The optimizer's hyperparameters (param groups)
are returned as JSON-able data, kept out of DCP's pickled objects.

- FSDP2, FSDP1, DDP: torch's ``get_state_dict`` / ``set_state_dict``
  (``torch.distributed.checkpoint.state_dict``), which already give this layout
  (FSDP2: DTensor row shards; FSDP1: its sharded state dict, gathered one unit at a time
  inside torch; DDP: whole tensors, written once).
- DeepSpeed ZeRO 1-3: `annot.engines.deepspeed_state`, which describes ZeRO's flat fp32
  partitions and optimizer state as chunks of the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from annot.engines.base import Trainable
from annot.errors import CheckpointError

__all__ = ["EngineState", "Reader", "TorchState", "groups_from_json", "groups_to_json"]

#: Reads the saved checkpoint into a state dict of this layout, in place (``dcp.load``).
Reader = Callable[[dict[str, Any]], None]


class EngineState(Protocol):
    """What `annot.save_state` / `annot.load_state` ask of an engine."""

    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        """``(state, param_groups, engine_extras)``: the tensors to hand to ``dcp.save``
        (this rank's pieces), the optimizer's param groups as JSON-able data (``params``:
        the bare names), and small engine counters (JSON-able)."""
        ...

    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        """Read model and optimizer state with ``read``; ``keys`` is the checkpoint's
        tensor metadata by key (shapes and dtypes, nothing read yet)."""
        ...


class TorchState:
    """FSDP2, FSDP1, DDP (and a plain module): torch's distributed state-dict API."""

    def __init__(self, trainable: Trainable) -> None:
        self.module = trainable.module
        self.optimizer = trainable.optimizer

    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return ({"model": model_sd, "optim": {"state": optim_sd["state"]}},
                groups_to_json(optim_sd["param_groups"]), {})

    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # get_state_dict creates the optimizer's state if it has none yet (a step with
        # zero gradients and lr 0), so there is something to read into.
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        read({"model": model_sd, "optim": {"state": optim_sd["state"]}})
        optim_sd["param_groups"] = groups_from_json(param_groups, optim_sd["param_groups"])
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd,
                       optim_state_dict=optim_sd)


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
