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
error, but for the three DCP's asynchronous save stages it with
(``torch.distributed._state_dict_utils``: ``zeros_like`` on the CPU, then ``copy_``):
``zeros_like`` / ``empty_like`` give a `FlatChunks` of the same chunks whose views are
storage of its own, as many elements as this rank holds (never the full shape), and
``copy_`` copies chunk by chunk between two such placeholders. So an asynchronous save
snapshots exactly this rank's pieces, and the engine's memory is free to change while
the snapshot is written.
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
    ``local``, so a load lands in place. Placeholders have no storage of their own, but
    for the staged copy DCP's asynchronous save makes (``zeros_like``): its chunks are
    views of one buffer of the elements this rank holds.
    """

    _boxes: dict[tuple[int, ...], torch.Tensor]
    _chunk_dtype: torch.dtype

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype,
                pieces: Sequence[tuple[int, int, torch.Tensor]]) -> FlatChunks:
        device = pieces[0][2].device if pieces else torch.device("cpu")
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
        return cls._of_boxes(shape, dtype, device, boxes)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FlatChunks(shape={tuple(self.shape)}, boxes={len(self._boxes)})"

    @classmethod
    def _of_boxes(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  boxes: dict[tuple[int, ...], torch.Tensor]) -> FlatChunks:
        """A placeholder whose chunks are ``boxes`` (offsets -> a view of that box's shape)."""
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        self._boxes = boxes
        self._chunk_dtype = dtype
        return self

    def _like(self, fill: str, dtype: torch.dtype | None, device: torch.device | None,
              pin_memory: bool | None) -> FlatChunks:
        """The same chunks in new memory (one buffer of the held elements, each chunk a
        view of it): DCP's staging buffer for an asynchronous save."""
        dtype = dtype or self._chunk_dtype
        device = torch.device(device) if device is not None else self.device
        total = sum(view.numel() for view in self._boxes.values())
        make = torch.zeros if fill == "zeros" else torch.empty
        buffer = make(total, dtype=dtype, device=device, pin_memory=bool(pin_memory))
        boxes: dict[tuple[int, ...], torch.Tensor] = {}
        position = 0
        for offsets, view in self._boxes.items():
            boxes[offsets] = buffer[position:position + view.numel()].view(view.shape)
            position += view.numel()
        return FlatChunks._of_boxes(self.shape, dtype, device, boxes)

    def _copy_from(self, source: Any, non_blocking: bool) -> FlatChunks:
        if not isinstance(source, FlatChunks) or source._boxes.keys() != self._boxes.keys():
            raise TypeError(f"FlatChunks.copy_ copies between placeholders of the same chunks "
                            f"(DCP's staging), not from {type(source).__name__}")
        for offsets, view in self._boxes.items():
            view.copy_(source._boxes[offsets], non_blocking=non_blocking)
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.detach.default:
            return args[0]
        # What DCP's asynchronous staging does to a tensor with no storage of its own
        # (torch.distributed._state_dict_utils._create_cpu_state_dict / _copy_state_dict).
        if func in (aten.zeros_like.default, aten.empty_like.default) and isinstance(args[0], FlatChunks):
            if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
                raise TypeError(f"FlatChunks: {func} with memory_format={kwargs['memory_format']} "
                                "is not defined (its chunks are contiguous)")
            return args[0]._like("zeros" if func is aten.zeros_like.default else "empty",
                                 kwargs.get("dtype"), kwargs.get("device"), kwargs.get("pin_memory"))
        if func is aten.copy_.default:
            if not isinstance(args[0], FlatChunks):
                raise TypeError(
                    f"a FlatChunks placeholder cannot be copied into a plain {type(args[0]).__name__} "
                    f"of shape {tuple(args[0].shape)} (this rank holds part of it only; DCP's "
                    "asynchronous staging does so for 0-d tensors): save it with async_save=False")
            return args[0]._copy_from(args[1], bool(args[2] if len(args) > 2 else kwargs.get("non_blocking")))
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
