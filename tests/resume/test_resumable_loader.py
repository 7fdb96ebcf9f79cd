"""`annot.ResumableLoader` in one process: the global sample order and its cut among
ranks (ranks simulated by ``rank=`` / ``world_size=``), a position that counts the
batches the loop got, carried to another world size, and saved and restored with
`annot.save_state(..., data=)` / `annot.load_state(..., data=)`."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

import annot
from annot.training_state import _data_state


class Indices(torch.utils.data.Dataset[int]):
    """Item i is i: batches show which samples they hold."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class Endless(torch.utils.data.Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self):
        return iter(range(4))


def flat(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def lockstep(loaders, steps: int) -> list[int]:
    """``steps`` steps of every rank's loader; the samples in rank order per step."""
    iterators = [iter(loader) for loader in loaders]
    return flat(next(it) for _ in range(steps) for it in iterators)


def test_ranks_take_consecutive_blocks_and_split_the_short_last_step():
    ranks = [annot.ResumableLoader(Indices(20), batch_size=3, rank=r, world_size=2) for r in range(2)]
    assert [len(loader) for loader in ranks] == [4, 4]  # 3 steps of 6, then 2 left: 1 each
    seen = lockstep(ranks, 4)
    assert seen == list(range(20))
    assert [loader.state_dict()["epoch"] for loader in ranks] == [1, 1]
    assert [loader.position for loader in ranks] == [0, 0]


def test_a_position_saved_on_two_ranks_continues_the_same_order_on_one():
    def loader(rank: int, world: int, batch: int) -> annot.ResumableLoader:
        return annot.ResumableLoader(Indices(30), batch_size=batch, shuffle=True, seed=5,
                                     rank=rank, world_size=world)

    straight = loader(0, 1, 4)  # the order itself: 2 epochs, one process
    order = [flat(straight), flat(straight)]
    assert sorted(order[0]) == list(range(30)) and order[0] != order[1]  # reshuffled
    two = [loader(r, 2, 2) for r in range(2)]
    assert lockstep(two, 3) == order[0][:12]
    assert two[0].state_dict() == two[1].state_dict()
    one = loader(0, 1, 4)
    one.load_state_dict(json.loads(json.dumps(two[0].state_dict())))
    assert flat(one) + flat(one) == order[0][12:] + order[1]
    assert one.state_dict()["epoch"] == 2


def test_the_position_counts_batches_handed_to_the_loop_not_those_prefetched():
    # A spawned worker: a forked one copies whatever locks the suite's earlier threads
    # held (OpenMP, gloo) and once died of a segmentation fault in CI.
    loader = annot.ResumableLoader(Indices(64), batch_size=4, num_workers=1, prefetch_factor=4,
                                   multiprocessing_context="spawn")
    batches = iter(loader)
    assert flat([next(batches)]) == [0, 1, 2, 3]
    assert loader.position == 4  # the worker has fetched up to 4 batches ahead by now
    del batches


def test_iterating_again_after_a_break_continues_where_the_loop_stopped():
    loader = annot.ResumableLoader(Indices(12), batch_size=2)
    assert flat(itertools.islice(loader, 2)) == [0, 1, 2, 3]
    assert flat(loader) == list(range(4, 12))
    assert flat(loader) == list(range(12))  # then the next epoch, from its start


def test_an_endless_dataset_is_read_in_index_order_without_epochs():
    loader = annot.ResumableLoader(Endless(), batch_size=3, rank=1, world_size=2)
    assert flat(itertools.islice(loader, 2)) == [3, 4, 5, 9, 10, 11]
    assert loader.state_dict() == {"epoch": 0, "position": 12, "size": None, "shuffle": False,
                                   "seed": 0}
    with pytest.raises(TypeError, match="endless"):
        len(loader)


@pytest.mark.parametrize(("build", "error", "match"), [
    (lambda: annot.ResumableLoader(Endless(), batch_size=2, shuffle=True), ValueError, "shuffle=False"),
    (lambda: annot.ResumableLoader(Indices(4), batch_size=2, sampler=[0, 1]), TypeError, "sampler"),
    (lambda: annot.ResumableLoader(Indices(4), batch_size=0), ValueError, "batch_size"),
    (lambda: annot.ResumableLoader(Indices(4), batch_size=2, rank=1), ValueError, "both rank"),
    (lambda: annot.ResumableLoader(Stream(), batch_size=2), TypeError,
     "map-style"),
])
def test_a_loader_it_cannot_resume_is_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_position_for_another_order_is_refused():
    saved = annot.ResumableLoader(Indices(8), batch_size=2, shuffle=True, seed=1).state_dict()
    other = annot.ResumableLoader(Indices(8), batch_size=2, shuffle=True, seed=2)
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="size=8.*size=9"):
        annot.ResumableLoader(Indices(9), batch_size=2, shuffle=True, seed=1).load_state_dict(saved)


# -- with the training state ---------------------------------------------------------------
def _trainable() -> annot.Trainable:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    return annot.Trainable(model, model, torch.optim.SGD(model.parameters(), lr=0.1), "local")


def _train(trainable: annot.Trainable, batches, steps: int) -> list[int]:
    seen = []
    for _ in range(steps):
        batch = next(batches)
        loss = trainable(batch.float()[:, None]).square().mean()
        trainable.backward(loss)
        trainable.step()
        trainable.zero_grad()
        seen += batch.tolist()
    return seen


def test_save_state_records_the_data_position_and_load_state_restores_it(tmp_path):
    def loader() -> annot.ResumableLoader:
        return annot.ResumableLoader(Indices(40), batch_size=4, shuffle=True, seed=3)

    first, data = _trainable(), loader()
    batches = iter(data)
    _train(first, batches, 3)
    annot.save_state(tmp_path, first, step=3, data=data)
    after = _train(first, batches, 2)

    again, restored = _trainable(), loader()
    annot.load_state(tmp_path, again, data=restored)
    assert restored.state_dict() == {"epoch": 0, "position": 12, "size": 40, "shuffle": True,
                                     "seed": 3}
    assert _train(again, iter(restored), 2) == after


def test_load_state_refuses_data_the_state_does_not_hold(tmp_path):
    trainable = _trainable()
    annot.save_state(tmp_path, trainable, step=1)
    with pytest.raises(annot.CheckpointError, match="no data position"):
        annot.load_state(tmp_path, trainable, data=annot.ResumableLoader(Indices(4), batch_size=2))
    with pytest.raises(TypeError, match="state_dict"):
        annot.save_state(tmp_path, trainable, step=2, data=iter([1, 2]))


def test_positions_that_differ_per_rank_are_not_spread_over_another_world(tmp_path):
    for rank, position in enumerate([4, 6]):  # as two ranks with loaders of their own saved
        (tmp_path / f"data-rank{rank:05d}.json").write_text(json.dumps({"position": position}))
    with pytest.raises(annot.CheckpointError, match="differ.*resume on 2 ranks"):
        _data_state(tmp_path, {"data": True, "world_size": 2})
    (tmp_path / "data-rank00001.json").write_text(json.dumps({"position": 4}))
    assert _data_state(tmp_path, {"data": True, "world_size": 2}) == {"position": 4}
