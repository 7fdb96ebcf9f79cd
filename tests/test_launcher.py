"""The test launcher (tests/distributed.py): a run past its timeout kills everything it
started, grandchildren included, and says what it printed; a failed launch's report puts
the ranks' own tracebacks first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.distributed import failure_report, run_process

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
