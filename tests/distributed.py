"""Multi-process tests: the one launcher every test uses, and the entry of every worker.

In the pytest process::

    from tests.distributed import torchrun

    proc = torchrun(WORKER, str(out), "scenario-a", "scenario-b", nproc=2, timeout=180)

runs ``WORKER`` under torchrun on a free port, with the repository root on ``PYTHONPATH``
(so workers import ``tests.…``, ``examples.…`` and this tree's ``annot``) and
``OMP_NUM_THREADS=1``, in a new session so that a hang past ``timeout`` kills torchrun and
every rank it started. A non-zero exit fails the test with the ranks' own tracebacks
first and torchrun's summary after them.

In a worker script (run by torchrun)::

    from tests.distributed import worker_main

    def run(*args: str) -> dict: ...  # this worker's own logic, called on every rank

    if __name__ == "__main__":
        worker_main(run)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 180

# The device switch of the whole suite: ANNOT_TEST_DEVICE=cpu (default) or cuda. Read here
# (and by tests/conftest.py, which skips every test with the reason when cuda is asked for
# and there is no CUDA device), and passed on to every torchrun worker in its environment.
DEVICE_VARIABLE = "ANNOT_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def test_device() -> str:
    """The suite's device, ``"cpu"`` or ``"cuda"``, from ``ANNOT_TEST_DEVICE`` (default
    cpu). Raises ``ValueError`` naming the variable for any other value."""
    value = os.environ.get(DEVICE_VARIABLE, "cpu").strip().lower() or "cpu"
    if value not in DEVICES:
        raise ValueError(f"{DEVICE_VARIABLE}={value!r}: set it to one of {', '.join(DEVICES)} "
                         "(or leave it unset for cpu)")
    return value


test_device.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def process_group_backend(device: str, nproc: int, gpus: int) -> str:
    """The backend of ``nproc`` ranks on ``device`` with ``gpus`` CUDA devices: gloo on
    the CPU; on CUDA, NCCL with one rank per GPU (``cpu:gloo,cuda:nccl``: the CPU tensors
    tests still exchange, ``all_gather_object`` among them, go through gloo) when every
    rank gets a GPU of its own, else gloo with every rank on ``cuda:0`` (NCCL refuses two
    ranks on one device)."""
    if device == "cpu":
        return "gloo"
    if gpus < 1:
        raise RuntimeError(f"{DEVICE_VARIABLE}=cuda but this machine has no CUDA device")
    return "cpu:gloo,cuda:nccl" if nproc <= gpus else "gloo"


def rank_device(device: str, local_rank: int, nproc: int, gpus: int) -> str:
    """The device a rank computes on: ``cuda:<local rank>`` when every rank has a GPU of
    its own, ``cuda:0`` for all when ranks outnumber GPUs, ``cpu`` on the CPU."""
    if device == "cpu":
        return "cpu"
    return f"cuda:{local_rank}" if nproc <= gpus else "cuda:0"


def worker_device() -> str:
    """In a worker: this rank's device (see `rank_device`), from the environment torchrun
    and `worker_env` set."""
    device = test_device()
    gpus = _cuda_device_count() if device == "cuda" else 0
    return rank_device(device, int(os.environ.get("LOCAL_RANK", "0")),
                       int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))), gpus)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_process(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: Path | str = ROOT, merge_stderr: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new session, stderr merged into stdout unless ``merge_stderr`` is
    false. A run past ``timeout`` kills the whole process group (the command and
    everything it started) and raises ``TimeoutError`` with the output so far."""
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} ran past {timeout}s:\n{out[-8000:]}\n{err or ''}") from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err or "")


def worker_env() -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH, one OpenMP thread
    per process (two ranks on two cores) and the suite's device (``ANNOT_TEST_DEVICE``,
    checked) for the workers. On ``cpu`` the workers see no GPU (``CUDA_VISIBLE_DEVICES``
    empty): annot's default device is this rank's GPU where there is one, and a CPU run
    on a GPU machine must compute where a CPU-only machine does."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    device = test_device()
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", DEVICE_VARIABLE: device}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


_RANK_LINE = re.compile(r"^\[(?:rank|default)(\d+)\]:")


def failure_report(proc: subprocess.CompletedProcess) -> str:
    """What a failed launch printed: the ranks' own lines first (their tracebacks; torch
    prefixes them with ``[rankN]:``), rank by rank, then the tail of the rest, torchrun's
    summary last."""
    lines = proc.stdout.splitlines()
    by_rank: dict[int, list[str]] = {}
    rest = []
    for line in lines:
        match = _RANK_LINE.match(line)
        if match:
            by_rank.setdefault(int(match.group(1)), []).append(line)
        else:
            rest.append(line)
    ranks = [line for rank in sorted(by_rank) for line in by_rank[rank]]
    if not ranks:  # no prefixed lines: a worker's unprefixed traceback, outside torchrun's
        ranks = _tracebacks(lines)
    parts = [f"{' '.join(map(str, proc.args))} exited {proc.returncode}"]
    if ranks:
        parts += ["--- the ranks' tracebacks:", *ranks[:200]]
        if len(ranks) > 200:
            parts.append(f"... ({len(ranks) - 200} more lines)")
    parts += ["--- the rest of the output (tail):", "\n".join(rest)[-4000:]]
    return "\n".join(parts)


def _tracebacks(lines: list[str]) -> list[str]:
    """Traceback blocks that are not torchrun's own (its frames are in run.py)."""
    blocks, current = [], None
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line and not line[0].isspace():  # the exception line ends the block
                if not any("torch/distributed/run.py" in x for x in current):
                    blocks += current
                current = None
    return blocks


def torchrun_command(script: Path | str, *args: str, nproc: int = WORLD_SIZE,
                     launcher: Sequence[str] = ()) -> list[str]:
    """The torchrun command running ``script ARGS`` on ``nproc`` ranks of this machine, on
    a free port; ``launcher``: torchrun's own options besides (``--max-restarts=1``)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *launcher,
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args]


def torchrun(script: Path | str, *args: str, nproc: int = WORLD_SIZE,
             timeout: float = LAUNCH_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script ARGS`` on ``nproc`` CPU ranks under torchrun (see the module
    docstring). With ``check``, a non-zero exit raises ``AssertionError`` with
    `failure_report`. Returns the completed process, stderr merged into stdout."""
    def launch() -> subprocess.CompletedProcess:
        return run_process(torchrun_command(script, *args, nproc=nproc), timeout=timeout, env=worker_env())

    scratch = {folder: set(folder.iterdir()) for folder in scratch_folders(args)}
    proc = launch()
    if check and proc.returncode != 0 and (crash := native_crash(proc.stdout)):
        # Seen once in about 25 launches of the HuggingFace matrix (glibc aborted a rank:
        # "malloc_consolidate(): unaligned fastbin chunk detected"), not reproduced in 15
        # more, 6 of them under glibc's malloc checking. One retry, reported as a warning;
        # a second crash, or any failure of the worker's own, fails the test. The retry
        # starts from the folders as they were: a save the first launch wrote before the
        # crash would otherwise be refused as "already holds a checkpoint".
        warnings.warn(f"a rank died of {crash} (a native crash); launching once more:\n"
                      f"{failure_report(proc)[-3000:]}", stacklevel=2)
        for folder, before in scratch.items():
            remove_new_entries(folder, before)
        proc = launch()
    if check and proc.returncode != 0:
        raise AssertionError(failure_report(proc))
    return proc


def scratch_folders(args: Sequence[str]) -> list[Path]:
    """The temporary folders a launch was given: each absolute argument that is a folder
    under the system's temporary directory (not that directory itself), or the folder of
    one that names a file there (existing or to be written). Never a folder of this
    repository, wherever it is checked out (a clone under /tmp too)."""
    tmp = Path(tempfile.gettempdir()).resolve()
    root = ROOT.resolve()
    folders = set()
    for arg in args:
        path = Path(arg)
        if not path.is_absolute():
            continue
        path = path.resolve()
        folder = path if path.is_dir() else path.parent
        if folder.is_dir() and tmp in folder.parents and not folder.is_relative_to(root):
            folders.add(folder)
    return sorted(folders)


def remove_new_entries(folder: Path, before: set[Path]) -> None:
    """Delete what is in ``folder`` now but was not in ``before`` (files and folders)."""
    for entry in set(folder.iterdir()) - before:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


# torchrun's summary line for a rank killed by a signal the worker did not ask for:
# SIGABRT (glibc's heap checks, C++ terminate), SIGBUS, SIGSEGV.
_CRASH_LINE = re.compile(r"exitcode\s*:\s*-(6|7|11)\b")
_SIGNALS = {"6": "SIGABRT", "7": "SIGBUS", "11": "SIGSEGV"}


def native_crash(output: str) -> str | None:
    """The signal that killed a rank, from torchrun's failure summary, if one did."""
    match = _CRASH_LINE.search(output)
    return _SIGNALS[match.group(1)] if match else None


def gathered(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def worker_main(run: Callable[..., Any]) -> None:
    """The entry of a worker script run under torchrun as ``script OUT [ARG ...]``: joins
    the process group (gloo on the CPU; with ``ANNOT_TEST_DEVICE=cuda`` the backend of
    `process_group_backend`, this rank's CUDA device made current), calls ``run(*ARGS)``
    on every rank, and rank 0 saves what it returns to OUT with ``torch.save``. All ranks then meet at a barrier (no rank leaves
    while another is still in a collective) and exit.

    A run that raised tears the group down and lets the traceback through. A run that
    succeeded exits at once after the barrier (``os._exit(0)``), skipping gloo's teardown:
    measured here, about one launch in thirty then aborted a rank in C++ ("terminate
    called without an active exception") while the group and the other rank's sockets
    closed, after the results were saved."""
    import torch
    import torch.distributed as dist

    out, *args = sys.argv[1:]
    device = test_device()
    if device == "cuda":
        gpus = _cuda_device_count()
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.cuda.set_device(torch.device(worker_device()))
        dist.init_process_group(process_group_backend(device, nproc, gpus))
    else:
        dist.init_process_group("gloo")
    try:
        result = run(*args)
        if dist.get_rank() == 0:
            torch.save(result, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
