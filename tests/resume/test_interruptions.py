"""Surviving interruptions (issue #44): examples/gpt/train.py --resume DIR on 2 CPU ranks
under ``torchrun --max-restarts 1``, with a fault injected on the first attempt
(tests/resume/interruption_worker.py), finishes with the final weights (a digest of
every weight, to the last bit) and every printed loss (``--digest``: each loss to the
last bit) of a run never interrupted:

- a rank killed (SIGKILL) mid-step, and one killed while a save commits;
- SIGUSR1 to one rank: both save the same step and exit 0; relaunched, the run goes on;
- a signal while an asynchronous save is still being written (from a thread, or from
  torch's checkpoint process): that save is committed first, and the relaunch resumes
  from the newer one;
- SIGTERM to the torchrun agent itself: the workers save and exit within torchrun's
  shutdown time; relaunched, the run goes on;
- the newest state damaged (a shard truncated; a rank's file removed): the resume names
  it and goes on from the state before;
- a rank stopped (SIGSTOP): the other ends within the collective timeout with an error
  naming it and a flight-recorder trace on disk, and torchrun's restart finishes the run.

Every launch runs under a hard timeout (a torchrun restart round was seen to stall 110 s).
All in the sweep lane: about 4 minutes of launches.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed import ROOT, run_process, torchrun_command, worker_env

pytestmark = [pytest.mark.distributed, pytest.mark.sweep]

WORKER = Path(__file__).with_name("interruption_worker.py")
MODEL = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--batch_size", "2", "--digest"]
STEPS = 8
LAUNCH_TIMEOUT_S = 240
#: torchrun's wait for its workers to stop before it kills them (its default is 30 s).
SHUTDOWN_TIMEOUT_S = 10


def _command(*args: str, restarts: int = 1) -> list[str]:
    return torchrun_command(WORKER, *MODEL, *args, nproc=2,
                            launcher=[f"--max-restarts={restarts}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"])


def _launch(*args: str, fault: str = "", restarts: int = 1, check: bool = True) -> str:
    env = {**worker_env(), "ANNOT_FAULT": fault}
    proc = run_process(_command(*args, restarts=restarts), timeout=LAUNCH_TIMEOUT_S, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def _losses(out: str) -> dict[int, str]:
    """Each printed step's loss as printed (the last bit: ``--digest``); a step printed
    twice (again after a restart) must print the same loss both times."""
    seen: dict[int, str] = {}
    for step, loss in re.findall(r"^step +(\d+) +loss (\S+)$", out, re.M):
        assert seen.setdefault(int(step), loss) == loss, f"step {step}: {seen[int(step)]} then {loss}"
    return seen


def _weights(out: str) -> str:
    found = re.findall(r"^weights (\w+)$", out, re.M)
    assert found, out[-3000:]
    return found[-1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, str]:
    """The uninterrupted runs: losses of steps 0-11 and the weights after 8 and 12 steps
    (saving every 2 steps, as the interrupted runs do)."""
    folder = tmp_path_factory.mktemp("straight")
    eight = _launch("--steps", str(STEPS), "--resume", str(folder / "a"), "--save-every", "2")
    twelve = _launch("--steps", "12", "--resume", str(folder / "b"), "--save-every", "4")
    return {"losses": _losses(twelve), STEPS: _weights(eight), 12: _weights(twelve)}


def _assert_like_straight(out: str, straight: dict, steps: int = STEPS) -> None:
    got = _losses(out)
    assert got, out[-3000:]
    assert {s: straight["losses"][s] for s in got} == got
    assert _weights(out) == straight[steps]


@pytest.mark.parametrize("fault", ["kill:5:1", "kill-in-commit:4:1"], ids=["mid-step", "in-commit"])
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_never_interrupted(fault, tmp_path, straight):
    out = _launch("--steps", str(STEPS), "--resume", str(tmp_path), "--save-every", "2", fault=fault)
    assert "resuming at step" in out  # the restart resumed from a committed save
    _assert_like_straight(out, straight)
    if fault.startswith("kill-in-commit"):
        # The save being committed when its rank died is not taken: the one before it is.
        assert "resuming at step 2 from step-00000002" in out


def test_sigusr1_to_one_rank_saves_both_at_the_same_step_and_exits_0(tmp_path, straight):
    out = _launch("--steps", str(STEPS), "--resume", str(tmp_path), fault="signal:4:1:SIGUSR1", restarts=0)
    assert "a signal to another rank: saved step 5" in out  # rank 0 was not signalled itself
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000005"]
    assert {f.name for f in (tmp_path / "step-00000005").glob("rng-rank*")} == {
        "rng-rank00000.json", "rng-rank00001.json"}
    assert max(_losses(out)) == 4  # no rank trained a step past the agreed boundary
    resumed = _launch("--steps", str(STEPS), "--resume", str(tmp_path), restarts=0)
    assert "resuming at step 5" in resumed
    _assert_like_straight(out + resumed, straight)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_signal_while_an_async_save_is_written_commits_it_then_saves_again(writer, tmp_path, straight):
    out = _launch("--steps", str(STEPS), "--resume", str(tmp_path), "--save-every", "2", "--async-save", writer,
                  fault="signal-after-save:4:0:SIGTERM", restarts=0)
    committed = sorted(p.name for p in tmp_path.glob("step-*"))
    assert committed[-2:] == ["step-00000004", "step-00000005"], committed
    assert re.search(r"saved step-00000004: training blocked [\d.]+ s, written in the background in "
                     r"[\d.]+ s, committed after [\d.]+ s", out), out[-3000:]
    resumed = _launch("--steps", str(STEPS), "--resume", str(tmp_path), restarts=0)
    assert "resuming at step 5" in resumed
    _assert_like_straight(out + resumed, straight)


def test_sigterm_to_the_torchrun_agent_saves_within_its_shutdown_time(tmp_path, straight):
    env = {**worker_env(), "ANNOT_FAULT": ""}
    # Enough steps that the signal lands mid-run; each step is short.
    cmd = _command("--steps", "100000", "--resume", str(tmp_path), restarts=0)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step   6"):
                os.kill(proc.pid, signal.SIGTERM)  # the agent, not a worker
                break
        started = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
        stopped_after = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    # The workers saved and left before torchrun's shutdown time ran out (it kills them then).
    assert stopped_after < SHUTDOWN_TIMEOUT_S and "forcefully" not in out, out[-3000:]
    saved = sorted(tmp_path.glob("step-*"))
    assert len(saved) == 1, out[-3000:]
    at = int(saved[0].name.removeprefix("step-"))
    assert at >= 7
    # Relaunched to at + 2 steps, against an uninterrupted run of as many.
    resumed = _launch("--steps", str(at + 2), "--resume", str(tmp_path), restarts=0)
    assert f"resuming at step {at}" in resumed
    whole = _launch("--steps", str(at + 2), "--resume", str(tmp_path / "whole"), restarts=0)
    assert {s: v for s, v in _losses(resumed).items()} == {s: _losses(whole)[s] for s in _losses(resumed)}
    assert _weights(resumed) == _weights(whole)


@pytest.mark.parametrize("damage", ["truncated shard", "missing rank file"])
def test_a_damaged_newest_state_is_named_and_the_one_before_it_resumes(damage, tmp_path, straight):
    _launch("--steps", str(STEPS), "--resume", str(tmp_path), "--save-every", "4", restarts=0)
    newest = tmp_path / "step-00000008"
    if damage == "truncated shard":
        shard = sorted(newest.glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        (newest / "rng-rank00001.json").unlink()
    out = _launch("--steps", "12", "--resume", str(tmp_path), "--save-every", "4", restarts=0)
    assert re.search(r"step-00000008: not loadable \(CheckpointError: .*(wrong size|absent)", out), out[-3000:]
    assert "resuming at step 4 from step-00000004" in out
    _assert_like_straight(out, straight, steps=12)


def test_a_stopped_rank_is_named_within_the_timeout_and_the_restart_finishes(tmp_path, straight):
    started = time.monotonic()
    out = _launch("--steps", str(STEPS), "--resume", str(tmp_path), "--save-every", "2",
                  "--collective-timeout", "5", fault="stop:5:1")
    elapsed = time.monotonic() - started
    assert re.search(r"a collective failed after the 5 s bound", out), out[-4000:]
    # Rank 1 passed boundary 5; published with its heartbeat, the report may be a beat late.
    assert re.search(r"rank 1 \(.*pid \d+\) stopped answering; last step boundary it reported "
                     r"\(at most a second old\): [1-5]\n", out), out[-4000:]
    trace = tmp_path / "collective-traces" / "attempt-0" / "rank_0"
    assert trace.is_file() and trace.stat().st_size > 0
    assert "resuming at step 4 from step-00000004 (restart 1)" in out
    _assert_like_straight(out, straight)
    assert elapsed < LAUNCH_TIMEOUT_S
