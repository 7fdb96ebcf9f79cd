"""Flat ranges of a tensor as torch distributed checkpoint (DCP) chunks.

Engines that shard *flattened* parameters (FSDP1, DeepSpeed ZeRO) keep on each rank a
contiguous range of a parameter's row-major elements, which need not start or end on a
row. DCP describes a saved tensor by rectangular chunks of its real shape. A flat range
is the union of at most ``2 * ndim - 1`` such boxes (a partial row, whole rows, a
partial row, recursively), each a contiguous slice of the local 1-D storage, so a rank
can write exactly what it holds and read exactly what it keeps, in the tensor's real
shape: a checkpoint written from flat shards is the same DCP checkpoint FSDP2's
row shards or whole tensors write, and each loads into the other.

`FlatChunks` is the value to put into the state dict handed to ``dcp.save`` /
``dcp.load``: a tensor placeholder of the full shape (no storage) that speaks DCP's
chunk protocol (the ``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__`` hooks DTensor implements). Any other operation on it is an
error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["FlatChunks", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``, in
    element order (each box is a contiguous run of the range)."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)
    if row0 == row1:
        return [((row0, *o), (1, *s)) for o, s in flat_boxes(shape[1:], col0, col1)]
    boxes: list[Box] = []
    if col0:
        boxes += [((row0, *o), (1, *s)) for o, s in flat_boxes(shape[1:], col0, inner)]
        row0 += 1
    if row1 > row0:
        boxes.append(((row0,) + (0,) * (len(shape) - 1), (row1 - row0, *shape[1:])))
    if col1:
        boxes += [((row1, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, col1)]
    return boxes


class FlatChunks(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds flat ranges, for DCP.

    ``pieces``: ``(start, stop, local)`` with ``local`` a contiguous tensor of at least
    ``stop - start`` elements (read flattened) holding (save) or receiving (load) elements
    ``[start, stop)`` of the flattened tensor. DCP reads from and writes into views of
    ``local``, so a load lands in place. Placeholders have no storage of their own.
    """

    _boxes: dict[tuple[int, ...], torch.Tensor]
    _chunk_dtype: torch.dtype

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype,
                pieces: Sequence[tuple[int, int, torch.Tensor]]) -> FlatChunks:
        device = pieces[0][2].device if pieces else torch.device("cpu")
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        boxes: dict[tuple[int, ...], torch.Tensor] = {}
        for start, stop, local in pieces:
            if not local.is_contiguous() or local.numel() < stop - start:
                raise ValueError(f"a flat piece [{start}, {stop}) needs a contiguous tensor of at "
                                 f"least {stop - start} elements, got shape {tuple(local.shape)}")
            local = local.view(-1)  # an engine may keep a whole parameter (FSDP1 on one rank)
            position = 0
            for offsets, sizes in flat_boxes(shape, start, stop):
                count = math.prod(sizes)
                boxes[offsets] = local[position:position + count].view(sizes)
                position += count
        self._boxes = boxes
        self._chunk_dtype = dtype
        return self

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FlatChunks(shape={tuple(self.shape)}, boxes={len(self._boxes)})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"FlatChunks is a checkpoint placeholder (no storage): {func} is not "
                        "defined on it")

    # DCP's chunk protocol (torch.distributed.checkpoint.planner_helpers / utils).
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                     sizes=torch.Size(view.shape)),
                          properties=TensorProperties(dtype=self._chunk_dtype),
                          size=self.shape))
            for offsets, view in self._boxes.items()
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(view.shape))
                for offsets, view in self._boxes.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        view = self._boxes.get(tuple(index.offset) if index.offset is not None else ())
        if view is None:
            raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset or ())}")
        return view
