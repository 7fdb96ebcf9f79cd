"""A stopped rank (SIGSTOP: alive, silent) fails the job within the bound set with
`annot.init_distributed(timeout=...)`, and the output names it (issue #20; torch's own
default would wait 30 minutes and name no rank).

The two ranks are started here with torchrun's environment (``RANK``, ``MASTER_PORT``,
...) rather than by torchrun, so the test measures annot's part: when the healthy rank
fails. torchrun then waits a further 30 s for a stopped rank before killing it (torch
2.13 does not apply ``--shutdown_timeout`` on its failure path), which docs/guides/trust.md states."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import free_port, worker_env

WORKER = Path(__file__).with_name("stuck_rank_worker.py")
TIMEOUT_S = 8


@pytest.mark.distributed
def test_a_stopped_rank_fails_the_job_within_the_bound_and_is_named():
    env = {**worker_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(TIMEOUT_S)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        started = time.monotonic()
        out, _ = ranks[0].communicate(timeout=120)
        elapsed = time.monotonic() - started
    finally:
        ranks[1].send_signal(signal.SIGKILL)  # stopped: only SIGKILL ends it
        ranks[1].wait()
    assert ranks[0].returncode != 0, out
    assert "annot: rank 0: rank 1 (" in out and f"pid {ranks[1].pid})" in out, out
    assert "has not answered" in out and "Timed out" in out, out
    waited = float(out.split("rank 0 waited ")[1].split(" s")[0])
    assert TIMEOUT_S - 1 <= waited <= TIMEOUT_S + 3, waited  # the collective's own bound
    assert elapsed < 45, elapsed  # start-up of two interpreters, then the bound
