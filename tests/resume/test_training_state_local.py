"""One process, no process group: flat ranges as DCP chunks, the commit protocol, the
metadata allowlist, and save_state / load_state end to end on a plain module (rotation,
the newest committed state, async save, refusals)."""

from __future__ import annotations

import math
import os
import pickle
import warnings

import pytest
import torch
from torch import nn

import annot
from annot.checkpoint_io import commit
from annot.checkpoint_io.dcp_metadata import read_metadata
from annot.checkpoint_io.flat_chunks import FlatChunks, flat_boxes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("shape", [(7,), (4, 6), (3, 4, 5), (2, 1, 3, 4), ()])
def test_flat_boxes_cover_each_range_exactly_in_order(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_boxes(shape, start, stop)
            got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
                             for off, size in boxes]) if boxes else torch.empty(0, dtype=full.dtype)
            assert torch.equal(got, full.reshape(-1)[start:stop]), (start, stop, boxes)


def test_flat_pieces_save_and_load_as_the_real_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    full = torch.randn(5, 7)
    flat = full.reshape(-1)
    pieces = [(0, 9, flat[:9].clone()), (9, 30, flat[9:30].clone()), (30, 35, flat[30:].clone())]
    dcp.save({"w": FlatChunks(full.shape, full.dtype, pieces)}, checkpoint_id=str(tmp_path / "a"))
    whole = torch.zeros(5, 7)
    dcp.load({"w": whole}, checkpoint_id=str(tmp_path / "a"))
    assert torch.equal(whole, full)
    # and back: a whole tensor read into a flat range that starts and ends mid-row
    dcp.save({"w": full}, checkpoint_id=str(tmp_path / "b"))
    part = torch.zeros(17)
    dcp.load({"w": FlatChunks(full.shape, full.dtype, [(12, 29, part)])}, checkpoint_id=str(tmp_path / "b"))
    assert torch.equal(part, flat[12:29])


def test_flat_chunks_refuse_arithmetic():
    chunks = FlatChunks((2, 2), torch.float32, [(0, 4, torch.zeros(4))])
    with pytest.raises(TypeError, match="placeholder"):
        chunks.sum()


def test_async_save_writes_flat_chunks_as_they_were_when_it_returned(tmp_path):
    """DCP's asynchronous save stages the placeholder (zeros_like, then copy_) and writes
    the staged copy: the engine's memory may change as soon as ``async_save`` returns."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(5, 7)
    local = full.reshape(-1)[3:30].clone()  # starts and ends mid-row: three chunks
    chunks = FlatChunks(full.shape, full.dtype, [(3, 30, local)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        future = dcp.async_save({"w": chunks}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
        local.fill_(-1.0)  # the next training step, while the save is being written
        future.result()
    whole = torch.zeros(5, 7)
    dcp.load({"w": FlatChunks(full.shape, full.dtype, [(3, 30, whole.view(-1)[3:30])])},
             checkpoint_id=str(tmp_path))
    assert torch.equal(whole.view(-1)[3:30], full.reshape(-1)[3:30])


def test_flat_chunks_staging_copy_holds_only_this_ranks_elements():
    local = torch.arange(40.0)
    chunks = FlatChunks((6, 7), torch.float32, [(5, 25, local)])
    staged = torch.zeros_like(chunks, device="cpu")
    assert isinstance(staged, FlatChunks)
    assert staged.__create_chunk_list__() == chunks.__create_chunk_list__()
    views = list(staged._boxes.values())
    assert sum(v.numel() for v in views) == 20  # the held range, not the 42 of the shape
    assert {v.untyped_storage().data_ptr() for v in views} != {local.untyped_storage().data_ptr()}
    staged.copy_(chunks)
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), local[:20])


def test_flat_chunks_refuse_to_be_copied_into_a_plain_tensor():
    """DCP stages a 0-d tensor as a plain one; a rank holding part of it cannot fill it."""
    chunks = FlatChunks((), torch.float32, [(0, 1, torch.ones(1))])
    with pytest.raises(TypeError, match="async_save=False"):
        torch.zeros(()).copy_(chunks)


def test_deepspeed_state_refuses_an_optimizer_wrapper_it_cannot_read():
    """Anything but ZeRO's optimizers and BF16_Optimizer, subclasses included, is refused
    by name before annot reads a single attribute of it (issue #30)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from annot.engines.deepspeed_state import DeepSpeedState

    class StageOne:
        def zero_optimization_stage(self) -> int:
            return 1

    class ZenFlowLike(DeepSpeedZeroOptimizer):
        pass

    model = nn.Linear(2, 2)
    wrapper = object.__new__(ZenFlowLike)  # no __init__: it needs a process group
    wrapper.optimizer = torch.optim.AdamW(model.parameters())
    trainable = annot.Trainable(StageOne(), model, wrapper, "deepspeed")  # type: ignore[arg-type]
    with pytest.raises(annot.CheckpointError, match="ZenFlowLike.*BF16_Optimizer"):
        DeepSpeedState(trainable)


def test_commit_renames_after_the_marker_and_checks_sizes(tmp_path):
    final = tmp_path / "ckpt"
    staging = commit.begin(final, {"files": ["a.bin"]})
    (staging / "a.bin").write_bytes(b"1234")
    assert not final.exists()
    commit.commit(staging, final)
    assert not staging.exists()
    assert commit.require_committed(final)["files"]["a.bin"] == 4
    (final / "a.bin").write_bytes(b"12")
    with pytest.raises(annot.CheckpointError, match="a.bin \\(wrong size\\)"):
        commit.require_committed(final)


def test_an_unfinished_save_is_refused_naming_what_is_missing(tmp_path):
    staging = commit.begin(tmp_path / "ckpt", {"files": ["a.bin", "b.bin"]})
    (staging / "a.bin").write_bytes(b"x")
    with pytest.raises(annot.CheckpointError) as refused:
        commit.require_committed(staging)
    assert "no commit marker" in str(refused.value) and "b.bin" in str(refused.value)
    assert "a.bin" not in str(refused.value).split("missing")[1]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/annot-pwned-by-metadata",))


def test_dcp_metadata_is_read_through_an_allowlist(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "good"))
    assert "w" in read_metadata(tmp_path / "good").state_dict_metadata
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(annot.CheckpointError, match="refused.*os.*system|refused.*posix.*system"):
        read_metadata(bad)
    assert not os.path.exists("/tmp/annot-pwned-by-metadata")


def _trainable(seed: int = 0) -> annot.Trainable:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return annot.Trainable(model, model, optimizer, "local")


def _step(trainable: annot.Trainable, scheduler=None) -> float:
    gen = torch.Generator().manual_seed(len(trainable.optimizer.state) + 7)
    loss = trainable(torch.randn(4, 6, generator=gen)).square().mean()
    trainable.backward(loss)
    trainable.step()
    trainable.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def test_save_and_load_state_in_one_process(tmp_path):
    first = _trainable()
    scheduler = torch.optim.lr_scheduler.StepLR(first.optimizer, 1, gamma=0.5)
    for step in range(1, 5):
        _step(first, scheduler)
        annot.save_state(tmp_path, first, step=step, scheduler=scheduler, extra={"seen": step},
                         keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    probe = torch.rand(2)  # the RNG state after the last save

    second = _trainable(seed=1)
    scheduler2 = torch.optim.lr_scheduler.StepLR(second.optimizer, 1, gamma=0.5)
    resumed = annot.load_state(tmp_path, second, scheduler=scheduler2)
    assert (resumed.step, resumed.extra, resumed.rng_restored) == (4, {"seen": 4}, True)
    assert torch.equal(torch.rand(2), probe)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(first.optimizer.state[a][key], second.optimizer.state[b][key])
    assert _step(first) == _step(second)


def test_async_save_commits_on_wait(tmp_path):
    trainable = _trainable()
    _step(trainable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pending = annot.save_state(tmp_path, trainable, step=1, async_save=True)
    assert isinstance(pending, annot.training_state.PendingSave)
    assert pending.wait() == tmp_path / "step-00000001"
    assert commit.is_committed(tmp_path / "step-00000001")
    again = _trainable(seed=3)
    annot.load_state(tmp_path, again)
    assert all(torch.equal(a, b) for a, b in zip(trainable.model.parameters(), again.model.parameters(), strict=True))


def test_load_state_refuses_what_it_cannot_resume(tmp_path):
    with pytest.raises(annot.CheckpointError, match="no committed training state"):
        annot.load_state(tmp_path, _trainable())
    trainable = _trainable()
    _step(trainable)
    annot.save_state(tmp_path, trainable, step=1)
    other = nn.Linear(6, 3)
    wrong = annot.Trainable(other, other, torch.optim.AdamW(other.parameters()), "local")
    with pytest.raises(annot.CheckpointError, match="param group 0 trains other parameters"):
        annot.load_state(tmp_path, wrong)
    same = _trainable()
    layers = same.model
    groups = torch.optim.AdamW([{"params": layers[0].parameters()}, {"params": layers[2].parameters()}])
    with pytest.raises(annot.CheckpointError, match="1 param groups, this one 2"):
        annot.load_state(tmp_path, annot.Trainable(layers, layers, groups, "local"))
    layers[0].weight.requires_grad_(False)
    frozen = torch.optim.AdamW([p for p in layers.parameters() if p.requires_grad])
    with pytest.raises(annot.CheckpointError, match="trains other parameters .*0.weight"):
        annot.load_state(tmp_path, annot.Trainable(layers, layers, frozen, "local"))
    with pytest.raises(TypeError, match="Trainable"):
        annot.load_state(tmp_path, trainable.model)  # type: ignore[arg-type]
    with pytest.raises(annot.CheckpointError, match="JSON"):
        annot.save_state(tmp_path, trainable, step=2, extra={"t": torch.ones(1)})


def test_annot_load_reads_the_model_out_of_a_training_state(tmp_path):
    trainable = _trainable()
    _step(trainable)
    saved = annot.save_state(tmp_path, trainable, step=1)
    fresh = _trainable(seed=5).model
    report = annot.load(fresh, saved)
    assert report.loaded == 4 and not report.missing
    assert all(torch.equal(a, b) for a, b in zip(trainable.model.parameters(), fresh.parameters(), strict=True))


@pytest.mark.parametrize("layout", ["torch", "lightning", "bare"])
def test_annot_load_reads_common_dcp_layouts_when_asked(tmp_path, layout):
    import torch.distributed.checkpoint as dcp

    source = _trainable().model
    state = {"torch": lambda sd: {"model": sd, "optim": {"state": {}}},
             # Lightning's FSDPStrategy(state_dict_type="sharded") saves {"model": the
             # LightningModule's state_dict, "optimizer_0": ...} (lightning 2.6,
             # pytorch/strategies/fsdp.py); a module holding the net as self.model.
             "lightning": lambda sd: {"model": {f"model.{k}": v for k, v in sd.items()},
                                      "optimizer_0": {"state": {}}},
             "bare": lambda sd: sd}[layout](source.state_dict())
    dcp.save(state, checkpoint_id=str(tmp_path))
    fresh = _trainable(seed=5).model
    with pytest.raises(annot.CheckpointError, match="pass dcp=True"):
        annot.load(fresh, tmp_path)  # a .metadata is a pickle: never read unasked
    annot.load(fresh, tmp_path, dcp=True)
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), fresh.parameters(), strict=True))
    if layout == "torch":
        with pytest.raises(annot.CheckpointError, match="missing 4"):
            annot.load(fresh, tmp_path, dcp=True, prefix="")


def test_flat_chunks_take_a_whole_parameter_as_its_flat_range(tmp_path):
    """FSDP1 on one rank keeps parameters unflattened: the piece is read as flat."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(3, 4)
    dcp.save({"w": full}, checkpoint_id=str(tmp_path))
    target = torch.zeros(3, 4)
    dcp.load({"w": FlatChunks((3, 4), torch.float32, [(0, 12, target)])}, checkpoint_id=str(tmp_path))
    assert torch.equal(target, full)
