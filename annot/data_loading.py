"""`ResumableLoader`: a data loader whose position is part of the training state, the same
on every rank and independent of the world size.

A resumed run must see the batches the uninterrupted run would have seen (issue #33):
saving the model, optimizer and RNG is not enough when the data restarts from its
beginning. torch's ``DistributedSampler`` knows its epoch but not how far into it the
loop got, and a sampler cannot count what the loop consumed: a ``DataLoader`` with
workers takes indices several batches ahead of the batch the loop holds.

Here the order of the samples is global: sample ``k`` of epoch ``e`` is ``order_e[k]``
(``range(len(dataset))``, or a permutation drawn from ``seed + e``), whatever the world
size. Each step takes the next ``world_size * batch_size`` samples of that order, rank
``r`` the ``r``-th block of ``batch_size``; the loader counts the batches it has handed
to the loop (not those its workers fetched ahead), so its position is the number of
samples the run consumed, the same on every rank. `annot.save_state(..., data=loader)`
records it and `annot.load_state(..., data=loader)` puts it back, on any world size: a
run resumed on another number of ranks continues the same sample order from the same
sample (only the cut into steps differs). docs/design.md, pitfall 32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from annot.process_group import rank_and_world

__all__ = ["ResumableLoader"]

_STATE_KEYS = ("epoch", "position", "size", "shuffle", "seed")


def _steps(start: int, end: int | None, world: int, batch: int,
           drop_last: bool) -> Iterator[tuple[int, int]]:
    """The global ``[first, stop)`` sample range of each step from ``start`` to ``end``
    (None: endless). A last step shorter than ``world * batch`` gives each rank
    ``remaining // world`` samples (the ``remaining % world`` after them are skipped so
    every rank gets as many), or is dropped with ``drop_last``."""
    first = start
    while end is None or first + world * batch <= end:
        yield first, first + world * batch
        first += world * batch
    assert end is not None
    if not drop_last and (end - first) // world > 0:
        yield first, end


def _rank_slice(first: int, stop: int, rank: int, world: int) -> range:
    """Rank ``rank``'s block of the step covering global samples ``[first, stop)``."""
    share = (stop - first) // world
    return range(first + rank * share, first + (rank + 1) * share)


class _StepSampler(Sampler[list[int]]):
    """The ``batch_sampler`` of the loader's ``DataLoader``: this rank's dataset indices
    of each step, from the position the loader set before the iteration began."""

    def __init__(self, owner: ResumableLoader) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        owner = self.owner
        rank, world = owner._rank_and_world()
        order = owner._order(owner.epoch)
        for first, stop in _steps(owner.position, owner.size, world, owner.batch_size,
                                  owner.drop_last):
            span = _rank_slice(first, stop, rank, world)
            yield [order[k] for k in span] if order is not None else list(span)

    def __len__(self) -> int:
        return self.owner._steps_left()


class ResumableLoader:
    """A ``DataLoader`` over ``dataset`` whose position (epoch and samples consumed) is
    saved and restored with the training state: pass it as ``data=`` to
    `annot.save_state` and `annot.load_state`.

    ``dataset``: map-style (``dataset[i]``). With ``len(dataset)`` it has epochs; without
    one it is an endless stream read in index order (``shuffle`` must then be false).
    ``batch_size``: samples per rank and step. ``shuffle``: each epoch in the order of
    ``torch.randperm`` seeded with ``seed + epoch``, the same on every rank.
    ``drop_last``: skip an epoch's last, incomplete step instead of splitting what is
    left evenly among the ranks. ``rank`` / ``world_size``: this rank's place among the
    ranks that take different data (default: the default process group's, read at each
    iteration; pass the data-parallel ones when other dimensions, such as tensor
    parallelism, share data). Every other keyword (``num_workers``, ``collate_fn``,
    ``pin_memory``, ...) goes to ``torch.utils.data.DataLoader``.

    Iterating continues from the current position to the end of the epoch (an endless
    dataset never ends); after an epoch's last batch the position moves to the start of
    the next epoch. Breaking out of the loop and iterating again continues where the loop
    stopped. ``state_dict()`` is the position after the last batch handed to the loop:
    JSON data, the same on every rank and for every world size.
    """

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, **dataloader_kwargs: Any) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("ResumableLoader needs a map-style dataset (dataset[i]); an "
                            f"IterableDataset ({type(dataset).__name__}) keeps its own position: "
                            "give save_state(data=...) an object whose state_dict() records it")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (samples per rank and step), "
                             f"got {batch_size!r}")
        owned = {"sampler", "batch_sampler", "shuffle", "drop_last"} & set(dataloader_kwargs)
        if owned:
            raise TypeError(f"ResumableLoader chooses the order itself: remove {sorted(owned)}")
        if dataloader_kwargs.get("in_order") is False:
            raise ValueError("ResumableLoader counts batches in the order they were planned: "
                             "in_order=False would let it count batches the loop has not seen")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither (the default process group's)")
        if world_size is not None and rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in range(world_size={world_size})")
        try:
            size: int | None = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            size = None
        if size is None and shuffle:
            raise ValueError(f"{type(dataset).__name__} has no len(): an endless stream is read in "
                             "index order; pass shuffle=False or give the dataset a __len__")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.size = size
        self.epoch = 0
        #: Samples of this epoch's order consumed by all ranks together.
        self.position = 0
        self._rank, self._world = rank, world_size
        self._permutation: tuple[int, list[int]] | None = None
        self.loader = DataLoader(dataset, batch_sampler=_StepSampler(self), **dataloader_kwargs)

    def _rank_and_world(self) -> tuple[int, int]:
        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        return rank_and_world()

    def _order(self, epoch: int) -> list[int] | None:
        """Epoch ``epoch``'s permutation of the dataset (None: index order)."""
        if not self.shuffle:
            return None
        if self._permutation is None or self._permutation[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            assert self.size is not None
            self._permutation = (epoch, torch.randperm(self.size, generator=gen).tolist())
        return self._permutation[1]

    def _steps_left(self) -> int:
        if self.size is None:
            raise TypeError(f"{type(self.dataset).__name__} is endless (no len()): no batch count")
        return sum(1 for _ in _steps(self.position, self.size, self._rank_and_world()[1],
                                     self.batch_size, self.drop_last))

    def __len__(self) -> int:
        """The batches this rank gets from the current position to the end of the epoch."""
        return self._steps_left()

    def __iter__(self) -> Iterator[Any]:
        world = self._rank_and_world()[1]
        plan = _steps(self.position, self.size, world, self.batch_size, self.drop_last)
        left = None if self.size is None else self._steps_left()
        epoch = self.epoch
        for handed, batch in enumerate(self.loader, start=1):
            # Counted before the loop gets the batch: a save after training on it
            # records it as consumed (code after a yield runs only at the next batch).
            self.position = next(plan)[1]
            if handed == left:
                self.epoch, self.position = epoch + 1, 0
            yield batch
        if left == 0:  # nothing left in this epoch (its tail too short to split)
            self.epoch, self.position = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``position``: samples of the epoch consumed by all
        ranks) and what the order depends on (``size``, ``shuffle``, ``seed``): JSON."""
        return {"epoch": self.epoch, "position": self.position, "size": self.size,
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the position in ``state`` (`state_dict`'s). Refuses a state for
        another order (dataset size, shuffle or seed differ), naming both values."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"not a ResumableLoader state: it lacks {', '.join(missing)}")
        for key in ("size", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the saved data position is for {key}={state[key]!r}, this loader has "
                    f"{key}={getattr(self, key)!r}: the same order is needed to continue it "
                    f"(build the loader with the saved {key})")
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and isinstance(position, int) and epoch >= 0
                and 0 <= position <= (self.size if self.size is not None else position)):
            raise ValueError(f"the saved data position (epoch {epoch!r}, sample {position!r}) "
                             f"is outside this dataset of {self.size} samples")
        self.epoch, self.position = epoch, position
