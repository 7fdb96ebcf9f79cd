"""The test launcher (tests/distributed.py): a run past its timeout kills everything it
started, grandchildren included, and says what it printed; a failed launch's report puts
the ranks' own tracebacks first; a rank's native crash is launched once more, from the
temporary folders as they were before the first launch, nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

from tests import distributed
from tests.distributed import (
    failure_report,
    remove_new_entries,
    run_process,
    scratch_folders,
    torchrun,
)

# A parent that starts a grandchild (a second process in the same group, not holding the
# output pipe, so only a group kill ends it), prints the grandchild's pid, and then both
# wait far past any timeout.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a dead parent is reaped by init; until then it is a zombie.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@pytest.mark.slow
def test_a_timeout_kills_the_whole_process_group_and_keeps_the_output():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 2s") as raised:
        run_process([sys.executable, "-c", _PARENT], timeout=2)
    assert time.monotonic() - started < 30
    grandchild = next(int(line) for line in str(raised.value).splitlines() if line.isdigit())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_the_report_puts_each_ranks_traceback_first():
    out = "\n".join([
        "torchrun noise", "[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: b",
        "[rank0]: Traceback (most recent call last):", "[rank0]: KeyError: a", "summary line",
    ])
    report = failure_report(subprocess.CompletedProcess(["torchrun", "w.py"], 1, out, ""))
    lines = report.splitlines()
    assert lines[0] == "torchrun w.py exited 1"
    assert lines[2:6] == ["[rank0]: Traceback (most recent call last):", "[rank0]: KeyError: a",
                          "[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: b"]
    assert lines[-1] == "summary line"


# Under torchrun: rank 1 aborts (as glibc does on a corrupted heap) in the first launch,
# which rank 0 marks by writing a line to a log that was there before the launch; it also
# makes a folder, as a save does, which must not exist yet. The second launch finds the
# line and passes, and finds no folder: what the first launch made was removed.
_WORKER = """
import os, sys, time
from pathlib import Path
log = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    with log.open("a") as f:
        f.write("launch\\n")
    (log.parent / "saved").mkdir()
else:
    time.sleep(1)  # rank 0 has counted this launch
    if len(log.read_text().splitlines()) == 1:
        os.abort()
"""


@pytest.mark.distributed
def test_a_native_crash_in_a_real_launch_is_launched_once_more_from_clean_folders(tmp_path):
    script, log = tmp_path / "worker.py", tmp_path / "launches"
    script.write_text(_WORKER)
    log.write_text("")
    with pytest.warns(UserWarning, match="SIGABRT") as caught:
        torchrun(script, str(log), timeout=120)
    assert len(log.read_text().splitlines()) == 2
    assert (tmp_path / "saved").is_dir()
    assert len([w for w in caught if "SIGABRT" in str(w.message)]) == 1


def test_scratch_folders_are_temporary_folders_given_or_holding_a_given_file(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "w.safetensors").write_text("")
    args = [str(tmp_path / "in"), str(tmp_path / "out" / "x.pt"), str(tmp_path / "new.pt"),
            "relative", str(distributed.ROOT / "tests"), tempfile.gettempdir()]
    assert scratch_folders(args) == sorted([tmp_path, tmp_path / "in"])


def test_remove_new_entries_keeps_what_was_there(tmp_path):
    (tmp_path / "old").write_text("kept, even when changed")
    before = set(tmp_path.iterdir())
    (tmp_path / "old").write_text("changed")
    (tmp_path / "new-file").write_text("")
    (tmp_path / "new-dir" / "deep").mkdir(parents=True)
    remove_new_entries(tmp_path, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


# torchrun's summary for a rank that died of a signal, and for one that raised.
_SUMMARY = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : {}"


@pytest.mark.parametrize(("exits", "launches", "passes"), [
    (["-6 (pid: 9)", "0"], 2, True),  # a crash, then a clean launch: passes
    (["-11 (pid: 9)", "-6 (pid: 9)"], 2, False),  # two crashes: fails after the second
    (["1 (pid: 9)", "0"], 1, False),  # the worker's own error: never launched again
])
def test_only_a_native_crash_is_launched_once_more(monkeypatch, exits, launches, passes):
    calls = []

    def fake_run(cmd, **_):
        code = exits[len(calls)]
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if code == "0" else 1, _SUMMARY.format(code), "")

    monkeypatch.setattr(distributed, "run_process", fake_run)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        if passes:
            torchrun("worker.py")
        else:
            with pytest.raises(AssertionError, match="exited 1"):
                torchrun("worker.py")
    assert len(calls) == launches
