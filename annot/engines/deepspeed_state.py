"""DeepSpeed ZeRO's model and optimizer state in the shared checkpoint layout.

ZeRO keeps, per rank, a flat fp32 partition per parameter group (the master weights)
and the optimizer state of that partition (the wrapped torch optimizer's
``state[partition]``); a parameter owns a contiguous range of it. Stage 3 also
partitions the parameters themselves (``ds_tensor``, and small "persistent" parameters
whole as well); stages 1 and 2 keep every parameter whole on every rank.

Each rank describes what it holds as `FlatChunks` of the parameter's real shape
(`annot.checkpoint_io.flat_chunks`), so ``model.<name>`` and
``optim.state.<name>.<key>`` are the same tensors torch's FSDP2 / FSDP1 / DDP write,
and a state moves between engines and world sizes through DCP's resharding. No rank
holds more than its own partitions (read in place; ZeRO-3's go through DeepSpeed's
``safe_get_local_*`` / ``safe_set_local_*``).

Where a parameter's range lies: stage 3, ``ds_tensor`` (as `annot.engines.deepspeed_partitions.
shard_layout` reads it) and DeepSpeed's public ``safe_get_local_fp32_param`` /
``safe_get_local_optimizer_state``; stages 1-2, which have no public local API, the
fragment mapping DeepSpeed links each parameter to (``param._hp_mapping``, what its own
universal checkpoint reads). Stages 1-2 may run under either of two wrappers with the
same mapping but other attribute names: ZeRO's own optimizer, or ``BF16_Optimizer``,
which DeepSpeed picks for ZeRO-1 with bf16 parameters and fp32 gradient accumulation
(``data_types.grad_accum_dtype: "fp32"``); any other wrapper is refused by name. The optimizer state is created from the checkpoint's keys
when the optimizer has not stepped yet (DeepSpeed creates it lazily at the first step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from annot.checkpoint_io.flat_chunks import FlatChunks
from annot.checkpoint_io.loading import state_names
from annot.engines.base import Trainable
from annot.engines.deepspeed_partitions import (
    partition_range,
    refresh_secondary_partitions,
    shard_layout,
)
from annot.engines.training_state import Reader, groups_from_json, groups_to_json
from annot.errors import CheckpointError
from annot.meta.layout import ShardLayout

__all__ = ["DeepSpeedState"]

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
# fp16's (dynamic) loss scale, so a resumed run scales as the saved one would have.
_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
Piece = tuple[int, int, torch.Tensor]  # elements [start, stop) of the flattened tensor, local 1-D


def _flat_attributes(zero: Any, stage: int) -> tuple[str, str]:
    """The attributes of ``zero`` (the optimizer DeepSpeed wrapped around the torch one)
    that hold its parameter groups and their flat fp32 partitions, for the wrappers whose
    layout annot reads: ZeRO's own (stages 1-3; fp16 and bf16 too) and, for ZeRO-1 with
    bf16 parameters and fp32 gradient accumulation (``data_types.grad_accum_dtype``),
    ``BF16_Optimizer``. Both link each parameter to its fragment of the partition
    (``_hp_mapping``). Any other wrapper, subclasses of these included (their state may
    live elsewhere), is refused by name rather than read wrong."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    known: dict[type, tuple[str, str]] = {
        DeepSpeedZeroOptimizer: ("bit16_groups", "single_partition_of_fp32_groups"),
        BF16_Optimizer: ("bf16_groups", "fp32_groups_flat_partition"),
        DeepSpeedZeroOptimizer_Stage3: ("fp16_groups", "fp32_partitioned_groups_flat"),
    }
    attrs = known.get(type(zero))
    if attrs is None or (stage == 3) != (type(zero) is DeepSpeedZeroOptimizer_Stage3):
        kind = type(zero)
        raise CheckpointError(
            f"annot cannot read DeepSpeed's {kind.__module__}.{kind.__qualname__} (ZeRO stage "
            f"{stage}): it saves and resumes DeepSpeedZeroOptimizer (ZeRO-1/2), "
            "DeepSpeedZeroOptimizer_Stage3 (ZeRO-3) and BF16_Optimizer (ZeRO-1 with bf16 and "
            "fp32 gradient accumulation); configure DeepSpeed to use one of these, or save "
            "with DeepSpeed's own engine.save_checkpoint")
    return attrs


class DeepSpeedState:
    """A `DeepSpeedTrainable`'s state: its ``DeepSpeedEngine``, ZeRO optimizer (stage
    1, 2 or 3, or ``BF16_Optimizer`` for ZeRO-1) and the torch optimizer inside it."""

    def __init__(self, trainable: Trainable) -> None:
        # DeepSpeed's engine and ZeRO optimizer: attributes torch's types do not declare.
        self.engine: Any = cast(Any, trainable.module)
        self.model = trainable.model
        self.zero: Any = trainable.optimizer
        self.inner: Any = getattr(self.zero, "optimizer", None)
        self.stage = int(self.engine.zero_optimization_stage())
        if self.stage not in (1, 2, 3) or not isinstance(self.inner, torch.optim.Optimizer):
            raise CheckpointError(
                f"annot saves DeepSpeed training state with ZeRO stages 1-3 and a torch optimizer "
                f"(this engine: stage {self.stage}, optimizer {type(self.inner).__name__})")
        # Which attributes hold the parameter groups and the fp32 partitions: they differ
        # between ZeRO's optimizer and BF16_Optimizer (issue #30).
        self._flat_attrs = _flat_attributes(self.zero, self.stage)
        # DeepSpeed's CPU Adam (ZeRO-Offload) keeps its step count as a Python int, which
        # its kernel takes as such; torch's optimizers keep a tensor.
        self._python_scalars = type(self.inner).__name__ == "DeepSpeedCPUAdam"
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self._layout: ShardLayout | None = None

    # -- where things are ---------------------------------------------------------------
    def _partitions(self) -> list[torch.Tensor]:
        """The flat fp32 partitions the torch optimizer steps (its state's keys)."""
        return list(getattr(self.zero, self._flat_attrs[1]))

    def _group_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each of the torch optimizer's param groups."""
        groups: list[list[nn.Parameter]] = [[] for _ in self.inner.param_groups]
        if self.stage == 3:
            for sub, params in enumerate(self.zero.fp16_groups):
                groups[self.zero.sub_group_to_group_id[sub]] += params
        else:
            for i, params in enumerate(getattr(self.zero, self._flat_attrs[0])):
                groups[i] += params
        return groups

    def _range(self, param: nn.Parameter) -> tuple[int, int]:
        """The elements of ``param`` (flattened) this rank's partition covers."""
        if self.stage == 3:
            return partition_range(param)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # no part of it in this rank's partition
            return 0, 0
        address = mapping.lp_fragment_address
        return address.start, address.start + address.numel

    def _master(self, param: nn.Parameter, key: str | None) -> torch.Tensor | None:
        """This rank's fp32 master weights (``key`` None) or optimizer state ``key`` of
        ``param``, a 1-D view into DeepSpeed's partition; None where it holds none."""
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            if key is None:
                return safe_get_local_fp32_param(param)
            return safe_get_local_optimizer_state(param, key)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        if key is None:
            return mapping.hp_fragment
        partition = self._partitions()[mapping.param_group_index]
        address = mapping.hp_fragment_address
        return self.inner.state[partition][key].narrow(0, address.start, address.numel)

    def _lp_pieces(self, param: nn.Parameter) -> list[list[Piece]]:
        """Where this rank keeps ``param``'s working (bit16 or fp32) values, one list per
        read: ZeRO-3 its partition, and a persistent parameter's whole value; ZeRO-1/2
        the whole parameter."""
        if self.stage != 3:
            return [[(0, param.numel(), param.data.view(-1))]]
        if self._layout is None:
            self._layout = shard_layout(self.model)
        parts = self._layout.parts.get(id(param), [])
        return [[(p.start, p.stop, p.destination)] for p in parts]

    def _state_keys(self) -> dict[str, bool]:
        """The torch optimizer's state keys -> whether per element (else a scalar)."""
        keys: dict[str, bool] = {}
        for partition in self._partitions():
            for key, value in self.inner.state.get(partition, {}).items():
                if self._python_scalars and isinstance(value, int | float):
                    keys[key] = False  # CPU Adam's step: saved as a tensor (`_scalar`)
                    continue
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"optimizer state {key!r} is {type(value).__name__}, not a tensor")
                if value.shape == partition.shape:
                    keys[key] = True
                elif value.numel() == 1:
                    keys[key] = False
                else:
                    raise CheckpointError(f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                                          f"neither per element nor a scalar")
        return keys

    def _scalar(self, key: str) -> torch.Tensor:
        """Optimizer state ``key`` that is one number per partition (``step``): equal in
        every partition, saved for every parameter."""
        found = [self.inner.state[p][key] for p in self._partitions() if key in self.inner.state.get(p, {})]
        if len({float(v) for v in found}) != 1:
            raise CheckpointError(f"DeepSpeed's partitions disagree on optimizer state {key!r}: "
                                  f"{sorted({float(v) for v in found})}")
        if not isinstance(found[0], torch.Tensor):  # DeepSpeed's CPU Adam counts in an int
            return torch.tensor(float(found[0]), dtype=torch.float32)  # as torch's Adam saves it
        return found[0].detach().clone()

    def _trained(self) -> list[tuple[str, nn.Parameter]]:
        return [(self.names[id(p)], p) for group in self._group_params() for p in group]

    def _chunks(self, param: nn.Parameter, local: torch.Tensor | None) -> FlatChunks:
        start, stop = self._range(param)
        pieces = [(start, stop, local.view(-1))] if local is not None and stop > start else []
        return FlatChunks(param.ds_shape if self.stage == 3 else param.shape,  # type: ignore[attr-defined]
                          local.dtype if local is not None else torch.float32, pieces)

    # -- save ---------------------------------------------------------------------------
    def save_dict(self) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        trained = self._trained()
        trained_ids = {id(p) for _, p in trained}
        model: dict[str, Any] = {}
        for name, tensor in state_names(self.model).items():
            if id(tensor) in trained_ids:
                model[name] = self._chunks(tensor, self._master(tensor, None))  # type: ignore[arg-type]
            elif isinstance(tensor, nn.Parameter) and self.stage == 3:
                pieces = self._lp_pieces(tensor)[0]
                model[name] = FlatChunks(tensor.ds_shape, tensor.dtype, pieces)  # type: ignore[attr-defined]
            else:
                model[name] = tensor.detach()
        state: dict[str, dict[str, Any]] = {}
        keys = self._state_keys()
        scalars = {key: self._scalar(key) for key, per_element in keys.items() if not per_element}
        for name, param in trained:
            state[name] = {key: self._chunks(param, self._master(param, key)) if per_element
                           else scalars[key] for key, per_element in keys.items()}
        scaler = getattr(self.zero, "loss_scaler", None)
        return ({"model": model, "optim": {"state": state}}, self._param_groups(),
                {**{k: int(getattr(self.engine, k, 0)) for k in _COUNTERS},
                 "loss_scaler": {k: float(getattr(scaler, k)) for k in _SCALER if hasattr(scaler, k)}})

    def _param_groups(self) -> list[dict[str, Any]]:
        return groups_to_json([{**{k: v for k, v in group.items() if k != "params"},
                                "params": [self.names[id(p)] for p in params]}
                               for group, params in zip(self.inner.param_groups, self._group_params(), strict=True)])

    # -- load ---------------------------------------------------------------------------
    def load(self, read: Reader, keys: dict[str, Any], param_groups: list[dict[str, Any]],
             engine_extras: dict[str, Any]) -> None:
        trained = self._trained()
        groups = groups_from_json(param_groups, self._param_groups())
        wanted = self._create_state(trained, keys)
        trained_ids = {id(p) for _, p in trained}

        # Pass 1: working values of every parameter (ZeRO-3 partitions, ZeRO-1/2 whole),
        # buffers, and the optimizer state; pass 2: fp32 master weights; pass 3: ZeRO-3's
        # persistent parameters whole. One key takes one destination per DCP read.
        setters: list[Callable[[], None]] = []
        first: dict[str, Any] = {}
        master: dict[str, Any] = {}
        whole: dict[str, Any] = {}
        for name, tensor in state_names(self.model).items():
            if not isinstance(tensor, nn.Parameter):
                first[name] = tensor.data
                continue
            lp = self._lp_pieces(tensor)
            shape = tensor.ds_shape if self.stage == 3 else tensor.shape  # type: ignore[attr-defined]
            first[name] = FlatChunks(shape, tensor.dtype, lp[0] if lp else [])
            if len(lp) > 1:
                whole[name] = FlatChunks(shape, tensor.dtype, lp[1])
            if id(tensor) in trained_ids:
                master[name] = self._destination(tensor, None, setters)
        scalars: dict[str, dict[str, torch.Tensor]] = {}
        state: dict[str, dict[str, Any]] = {}
        for name, param in trained:
            state[name] = {}
            for key, per_element in wanted.items():
                if per_element:
                    state[name][key] = self._destination(param, key, setters)
                else:
                    scalars.setdefault(key, {})[name] = torch.zeros((), dtype=keys[f"optim.state.{name}.{key}"].properties.dtype)
                    state[name][key] = scalars[key][name]
        with torch.no_grad():
            read({"model": first, "optim": {"state": state}})
            read({"model": master})
            if whole:
                read({"model": whole})
            for setter in setters:
                setter()
            for key, values in scalars.items():
                distinct = {float(v) for v in values.values()}
                if len(distinct) > 1:
                    raise CheckpointError(
                        f"the checkpoint's optimizer state {key!r} differs between parameters "
                        f"({sorted(distinct)[:4]}), but DeepSpeed keeps one per partition")
                value = next(iter(values.values()))
                for partition in self._partitions():
                    self.inner.state[partition][key] = (int(value.item()) if self._python_scalars
                                                        else value.clone())
        refresh_secondary_partitions(self.model)  # ZeRO++ hpZ: cut from the values before
        for group, loaded in zip(self.inner.param_groups, groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        for counter in _COUNTERS:
            if counter in engine_extras:
                setattr(self.engine, counter, int(engine_extras[counter]))
        scaler = getattr(self.zero, "loss_scaler", None)
        for key, value in (engine_extras.get("loss_scaler") or {}).items():
            if key in _SCALER and hasattr(scaler, key):
                current = getattr(scaler, key)
                setattr(scaler, key, int(value) if isinstance(current, int) else value)

    def _create_state(self, trained: list[tuple[str, nn.Parameter]],
                      keys: dict[str, Any]) -> dict[str, bool]:
        """The checkpoint's optimizer keys (-> per element), created in the torch
        optimizer's state where it has none yet (DeepSpeed creates it at the first step)."""
        wanted: dict[str, bool] = {}
        dtypes: dict[str, torch.dtype] = {}
        by_name = dict(trained)
        for key, meta in keys.items():
            # optim.state.<parameter name>.<state key>: state keys have no dots.
            name, _, state_key = key.removeprefix("optim.state.").rpartition(".")
            param = by_name.get(name) if key.startswith("optim.state.") else None
            if param is None:
                continue
            shape = tuple(param.ds_shape if self.stage == 3 else param.shape)  # type: ignore[attr-defined]
            if tuple(meta.size) == shape:
                wanted[state_key] = True
            elif len(meta.size) == 0:
                wanted[state_key] = False
            else:
                raise CheckpointError(f"{key}: shape {tuple(meta.size)} is neither {name}'s "
                                      f"{shape} nor a scalar")
            dtypes.setdefault(state_key, meta.properties.dtype)
        for partition in self._partitions():
            state = self.inner.state[partition]
            for state_key, per_element in wanted.items():
                if state_key not in state:
                    state[state_key] = (torch.zeros_like(partition) if per_element
                                        else 0 if self._python_scalars
                                        else torch.zeros((), dtype=dtypes[state_key]))
        return wanted

    def _destination(self, param: nn.Parameter, key: str | None,
                     setters: list[Callable[[], None]]) -> FlatChunks:
        """Where to read ``param``'s master weights or state ``key``: DeepSpeed's own
        memory for ZeRO-1/2. For ZeRO-3, what ``safe_get_local_*`` returns (DeepSpeed's
        memory too, unless the state lives on another device, when it is a copy), handed
        back through ``safe_set_local_*`` after reading (``setters``)."""
        local = self._master(param, key)
        if self.stage != 3 or local is None:
            return self._chunks(param, local)

        def hand_over() -> None:
            from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

            if key is None:
                safe_set_local_fp32_param(param, local)
            else:
                safe_set_local_optimizer_state(param, local, key)

        setters.append(hand_over)
        return self._chunks(param, local)
