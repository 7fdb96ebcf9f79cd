"""Where this rank keeps each parameter of a model an engine sharded.

Materializing, loading and saving fill or read a sharded model without knowing the
engine: an FSDP2 parameter is a DTensor and says where its rows are by itself; an engine
that shards *flattened* parameters (FSDP1, DeepSpeed ZeRO-3) describes them with a
`ShardLayout` built by that engine's module (`annot.engines.fsdp1.shard_layout`,
`annot.engines.deepspeed.shard_layout`). This module is data only: engine internals
stay in the engine modules (docs/design.md, "Layout").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

__all__ = ["Block", "FlatPart", "ShardLayout", "WHOLE", "dtensor_block", "local", "placement_block"]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (the tensor itself, so a
    write into it is a write into the DTensor), any other tensor itself."""
    # The DTensor's own local tensor rather than `to_local()`, which runs an autograd
    # function for a graph that shape checks and no-grad fills never use: 2.9 ms against
    # 0.01 ms for 201 tensors, and a 1.1B load asks about 1,200 times (measured).
    part = getattr(tensor, "_local_tensor", None)
    return tensor if part is None else part


@dataclasses.dataclass(frozen=True)
class Block:
    """The part of a full tensor a rank keeps: indices ``start[d]`` to
    ``start[d] + shape[d]`` in every dimension ``d``."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.shape, strict=True))

    def rows_only(self, full_shape: tuple[int, ...]) -> bool:
        """Whether only dimension 0 is narrowed (the block is a run of whole rows)."""
        return tuple(self.shape[1:]) == tuple(full_shape[1:])


def dtensor_block(tensor: torch.Tensor) -> Block | None:
    """Where this rank's local part of a DTensor lies in the full tensor; ``None`` for any
    other tensor.

    Placements are applied mesh dimension by mesh dimension, as torch does, so a
    tensor-parallel shard that FSDP2 shards again (``_StridedShard`` on the data-parallel
    dimension, ``Shard`` on ``"tp"``) gives this rank's exact rows and columns. Raises
    ``ValueError`` for a placement that is not a shard or a replica, or a part that is
    not one rectangular block (strided rows a rank keeps in pieces).
    """
    if not hasattr(tensor, "device_mesh"):
        return None
    from torch.distributed.tensor import DTensor

    assert isinstance(tensor, DTensor)  # what has a device_mesh; the import stays lazy
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not in the tensor's device mesh")
    return placement_block(tuple(tensor.shape), tuple(tensor.placements), tuple(mesh.shape),
                           tuple(coordinate))


def placement_block(full: tuple[int, ...], placements: tuple[object, ...],
                    mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Block:
    """`dtensor_block` of a tensor of shape ``full`` with ``placements`` on a mesh of
    ``mesh_shape``, on the rank at ``coordinate`` in it."""
    from torch.distributed.tensor import Replicate, Shard

    if all(type(p) is Shard or isinstance(p, Replicate) for p in placements):
        return _plain_shards_block(full, placements, mesh_shape, coordinate)
    return _indexed_block(full, placements, mesh_shape, coordinate)


def _plain_shards_block(full: tuple[int, ...], placements: tuple[object, ...],
                       mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Block:
    """Plain shards (``torch.chunk`` of what the previous mesh dimensions left) and
    replicas: a block by integer arithmetic. Working out index tensors for this, as the
    general case must, was a fifth of mapping a 1.1B model's shards (profiled)."""
    from torch.distributed.tensor import Shard

    shape, start = list(full), [0] * len(full)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            size, offset = Shard.local_shard_size_and_offset(
                shape[placement.dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            shape[placement.dim] = size
            start[placement.dim] += offset
    return Block(tuple(s if n else 0 for s, n in zip(start, shape, strict=True)), tuple(shape))


def _indexed_block(full: tuple[int, ...], placements: tuple[object, ...],
                   mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Block:
    """Any shard placement (``_StridedShard`` too): the full-tensor index of every row
    kept, checked to be one run."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = list(full)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(f"placement {placement} keeps no block of the full tensor")
        dim = placement.dim
        size, index = _get_shard_size_and_offsets(
            shape[dim], mesh_shape[mesh_dim], coordinate[mesh_dim], placement, offsets.get(dim),
            full[dim], False)
        assert index is not None  # offsets are asked for (skip_offset=False)
        shape[dim], offsets[dim] = size, index
    start = [0] * len(full)
    for dim, index in offsets.items():
        first = int(index[0]) if shape[dim] else 0
        if shape[dim] and not torch.equal(index, torch.arange(first, first + shape[dim])):
            raise ValueError(f"placements {placements} give this rank rows {index.tolist()} "
                             f"of dimension {dim}: not one block")
        start[dim] = first
    return Block(tuple(start), tuple(shape))


@dataclasses.dataclass(frozen=True)
class FlatPart:
    """Elements ``[start, stop)`` of a flattened full tensor of ``full_shape``, which this
    rank keeps in the first ``stop - start`` elements of ``destination`` (1-D)."""

    destination: torch.Tensor
    start: int
    stop: int
    full_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How an engine keeps a model's parameters on this rank.

    ``parts``: ``id(parameter) -> its flat parts here`` for flattened-sharded parameters
    (absent: whole, or a DTensor). ``wrapper_names``: module names the engine inserts into
    paths (FSDP1's ``_fsdp_wrapped_module``), which no checkpoint key contains.
    ``engine``: who built it, for messages. ``gather(parameter)``: the whole parameter,
    gathered by the engine (collective: every rank calls it for the same parameters in
    the same order)."""

    parts: Mapping[int, list[FlatPart]] = dataclasses.field(default_factory=dict)
    wrapper_names: frozenset[str] = frozenset()
    engine: str = ""
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def flat(self) -> bool:
        """Whether any parameter is kept as flat parts."""
        return bool(self.parts)

    def clean(self, path: str) -> str:
        """``path`` without the engine's wrapper levels: the bare model's name."""
        if not self.wrapper_names:
            return path
        return ".".join(p for p in path.split(".") if p not in self.wrapper_names)

    def bare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model an engine's root wrapper holds (the wrapper itself otherwise)."""
        for name in self.wrapper_names:
            inner = model._modules.get(name)
            if inner is not None:
                return inner
        return model

    def merged(self, other: ShardLayout) -> ShardLayout:
        """Both layouts in one (a model holds one engine's, but asking each is simplest)."""
        return ShardLayout({**self.parts, **other.parts}, self.wrapper_names | other.wrapper_names,
                           "+".join(e for e in (self.engine, other.engine) if e),
                           self.gather or other.gather)


WHOLE = ShardLayout()
"""Every parameter whole or a DTensor: plain models, DDP, FSDP2."""
