"""Where a rank's part of a DTensor lies: `placement_block` against torch's own chunking.

No process group is needed: a placement's block depends only on the full shape, the
mesh's shape and the rank's coordinate in it. The oracle applies ``torch.chunk`` mesh
dimension by mesh dimension, as DTensor's ``distribute_tensor`` does, to a tensor
holding each element's own index, so the block must select exactly those elements.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from annot.meta.layout import _indexed_block, _plain_shards_block, placement_block

MESHES = [(2,), (3,), (4,), (2, 2), (2, 3)]
SHAPES = [(7, 5), (8, 6), (1, 3), (2, 9)]  # uneven, even, fewer rows than ranks


def _chunked(full: torch.Tensor, placements: tuple, mesh_shape: tuple[int, ...],
             coordinate: tuple[int, ...]) -> torch.Tensor:
    part = full
    for placement, ranks, rank in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, Shard):
            pieces = torch.chunk(part, ranks, dim=placement.dim)
            part = pieces[rank] if rank < len(pieces) else part.narrow(placement.dim, 0, 0)
    return part


def _cases(mesh_shape: tuple[int, ...]):
    kinds = [Shard(0), Shard(1), Replicate()]
    for shape in SHAPES:
        for placements in itertools.product(kinds, repeat=len(mesh_shape)):
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                yield shape, placements, coordinate


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_the_block_holds_what_torch_chunking_gives_the_rank(mesh_shape):
    for shape, placements, coordinate in _cases(mesh_shape):
        case = f"shape {shape}, {placements} at {coordinate}"
        full = torch.arange(shape[0] * shape[1]).view(shape)
        expected = _chunked(full, placements, mesh_shape, coordinate)
        block = placement_block(shape, placements, mesh_shape, coordinate)

        assert block.shape == tuple(expected.shape), case
        if expected.numel():
            assert torch.equal(full[block.slices()], expected), case
        # The integer path (plain shards) and the index path agree on every case.
        assert block == _indexed_block(shape, placements, mesh_shape, coordinate), case
        assert block == _plain_shards_block(shape, placements, mesh_shape, coordinate), case


def test_a_placement_that_is_neither_shard_nor_replica_is_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(ValueError, match="keeps no block"):
        placement_block((4, 4), (Partial(),), (2,), (0,))
