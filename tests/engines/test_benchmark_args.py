"""`examples/benchmark.py`'s table driver hands ``--device`` and ``--backend`` to every row
it launches, and leaves them out (the run's own defaults) when not given."""

from __future__ import annotations

import subprocess

import pytest

from examples import benchmark


@pytest.fixture
def launched(monkeypatch):
    commands: list[list[str]] = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="")
    monkeypatch.setattr(benchmark.subprocess, "run", run)
    return commands


def test_the_table_passes_device_and_backend_to_each_row(launched):
    args = benchmark.parse_args(["--table", "--device", "cuda", "--backend", "gloo"])
    benchmark.launch(args, "zero3", "plain")
    [cmd] = launched
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--backend") + 1] == "gloo"


def test_without_them_each_row_takes_init_distributed_s_defaults(launched):
    benchmark.launch(benchmark.parse_args(["--table"]), "ddp", "plain")
    [cmd] = launched
    assert "--device" not in cmd and "--backend" not in cmd
