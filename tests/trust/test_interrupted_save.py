"""`annot.save` killed at every step of its commit (issue #20, docs/design.md pitfall 18):
the folder loads as the old checkpoint or the new one every time, files annot does not
own are never touched, and the next save removes what the killed one left.

Each kill is exact, not timing luck: a forked child replaces `commit.reached` (called
before every step that changes the folder) with one that SIGKILLs itself at the n-th
step; the parent then loads the folder."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import annot
from annot.checkpoint_io import weights_commit as commit
from examples.gpt.model import GPT

SHAPE = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, block_size=32)
SHARDED = 20_000  # bytes per shard: the GPT above then takes several files
WHOLE = 10**12


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(**SHAPE)


def _user_files(folder):
    (folder / "tokenizer.json").write_text('{"mine": true}')
    (folder / "notes").mkdir()
    (folder / "notes" / "run.txt").write_text("lr 3e-4")


def _assert_user_files_kept(folder):
    assert (folder / "tokenizer.json").read_text() == '{"mine": true}'
    assert (folder / "notes" / "run.txt").read_text() == "lr 3e-4"


def _labels(folder, new, shard_bytes, monkeypatch) -> list[str]:
    """The steps of one save of ``new`` over what ``folder`` holds (into a copy of it)."""
    seen: list[str] = []
    copy = folder.parent / "probe"
    os.system(f"cp -r {folder} {copy}")  # noqa: S605 - a test's own temporary folders
    monkeypatch.setattr(commit, "reached", seen.append)
    annot.save(new, copy, overwrite=True, max_shard_bytes=shard_bytes)
    monkeypatch.undo()
    return seen


def _save_killed_at(step: int, new, folder, shard_bytes) -> None:
    pid = os.fork()
    if pid == 0:  # the child: save, and die at the step-th step
        torch.set_num_threads(1)
        count = iter(range(step + 1))

        def reached(label: str) -> None:
            if next(count) == step:
                os.kill(os.getpid(), signal.SIGKILL)

        commit.reached = reached
        try:
            annot.save(new, folder, overwrite=True, max_shard_bytes=shard_bytes)
        finally:
            os._exit(3)  # not reached: the kill comes first
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _which(folder, old, new) -> str:
    loaded = GPT(**SHAPE)
    annot.load(loaded, folder)
    state = loaded.state_dict()
    for label, model in (("old", old), ("new", new)):
        if all(torch.equal(state[k], v) for k, v in model.state_dict().items()):
            return label
    raise AssertionError("the folder loads neither the old nor the new checkpoint")


# A kill at every step of a save, each step fsynced: 2-4 s per case with shards, so the
# fast lane keeps the single-file case and the full suite runs all four.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("old_bytes, new_bytes", [
    pytest.param(WHOLE, WHOLE, id="single->single"),
    pytest.param(SHARDED, SHARDED, id="shards->same shard names", marks=_SLOW),
    pytest.param(WHOLE, SHARDED, id="single->shards", marks=_SLOW),
    pytest.param(SHARDED, WHOLE, id="shards->single", marks=_SLOW),
])
def test_a_kill_at_any_step_leaves_old_or_new(tmp_path, monkeypatch, old_bytes, new_bytes):
    old, new = _model(0), _model(1)
    folder = tmp_path / "ck"
    annot.save(old, folder, max_shard_bytes=old_bytes)
    _user_files(folder)
    steps = _labels(folder, new, new_bytes, monkeypatch)
    assert len(steps) >= 2, steps
    outcomes = []
    for step in range(len(steps)):
        _save_killed_at(step, new, folder, new_bytes)
        outcomes.append(_which(folder, old, new))
        _assert_user_files_kept(folder)
        annot.save(old, folder, overwrite=True, max_shard_bytes=old_bytes)  # back to the start
    assert outcomes[0] == "old", outcomes  # killed before the commit point
    assert "new" in outcomes, (steps, outcomes)  # and after it
    annot.save(new, folder, overwrite=True, max_shard_bytes=new_bytes)
    assert _which(folder, old, new) == "new"
    assert not [p for p in folder.iterdir() if p.name.startswith(commit.TMP_PREFIX)]


def test_the_next_save_removes_what_a_killed_one_left(tmp_path):
    folder = tmp_path / "ck"
    annot.save(_model(0), folder)
    _save_killed_at(0, _model(1), folder, WHOLE)  # before the first step: staged files remain
    assert [p for p in folder.iterdir() if p.name.startswith(commit.TMP_PREFIX)]
    annot.save(_model(1), folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]


def test_overwrite_keeps_the_users_other_files(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    _user_files(folder)
    annot.save(_model(0), folder)  # a folder without a checkpoint needs no overwrite=True
    annot.save(_model(1), folder, overwrite=True, max_shard_bytes=SHARDED)
    _assert_user_files_kept(folder)
    annot.save(_model(2), folder, overwrite=True)  # shards -> one file: the shards go
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "notes", "tokenizer.json"]


def test_a_folder_with_a_checkpoint_needs_overwrite(tmp_path):
    annot.save(_model(0), tmp_path / "ck")
    with pytest.raises(annot.CheckpointError, match="already holds a checkpoint .*overwrite=True"):
        annot.save(_model(1), tmp_path / "ck")


def test_a_file_as_the_target_is_a_clear_error(tmp_path):
    (tmp_path / "ck").write_text("x")
    with pytest.raises(annot.CheckpointError, match="is a file"):
        annot.save(_model(0), tmp_path / "ck")
