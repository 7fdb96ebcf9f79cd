"""`annot rewrite` and the files it is given (issue #20): it never replaces a file the user
may not write, writes through symbolic links, reports every folder it cannot read, and a
file that would crash the parser fails alone while every other file is still processed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from annot.rewriter.cli import main

MODEL = """import torch.nn as nn


class Block(nn.Module):
    def forward(self, x):
        return x


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
"""


def _rewrite(*argv: str) -> int:
    return main(["--target", "torch", *argv])


def test_a_read_only_file_is_refused_and_left_as_it_was(tmp_path, capsys):
    file = tmp_path / "model.py"
    file.write_text(MODEL)
    file.chmod(0o444)
    assert _rewrite(str(file)) == 2
    assert file.read_text() == MODEL
    assert "model.py is read-only; not rewritten" in capsys.readouterr().err


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    real = tmp_path / "real.py"
    real.write_text(MODEL)
    link = tmp_path / "link.py"
    link.symlink_to("real.py")
    assert _rewrite(str(link)) == 0
    assert link.is_symlink() and os.readlink(link) == "real.py"
    assert "checkpoint" in real.read_text()


def test_a_file_reached_twice_is_rewritten_once(tmp_path, capsys):
    (tmp_path / "real.py").write_text(MODEL)
    (tmp_path / "link.py").symlink_to("real.py")
    assert _rewrite(str(tmp_path)) == 0
    assert "1 file(s) changed" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_file_too_deep_for_the_parser_fails_alone(tmp_path, jobs):
    """3000 nested parentheses overflowed libcst's native parser (a segfault under -j 1, a
    broken process pool under -j 2, so no file was rewritten). Run in a subprocess: a
    crash would take pytest with it."""
    (tmp_path / "deep.py").write_text("x = " + "(" * 3000 + "1" + ")" * 3000 + "\n")
    (tmp_path / "model.py").write_text(MODEL)
    result = subprocess.run([sys.executable, "-m", "annot.cli", "rewrite", "--target", "torch", "-j", jobs,
                             str(tmp_path)], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2, result.stderr
    assert "deep.py:1:1: too deeply nested to parse" in result.stderr
    assert "checkpoint" in (tmp_path / "model.py").read_text()


def test_an_unreadable_folder_is_reported():
    """Run as an unprivileged user where the tests run as root (root reads any folder),
    in a folder of its own (pytest's are private to their owner)."""
    with tempfile.TemporaryDirectory() as folder:
        _check_unreadable_folder(Path(folder))


def _check_unreadable_folder(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "model.py").write_text(MODEL)
    (tmp_path / "closed").mkdir()
    (tmp_path / "closed" / "model.py").write_text(MODEL)
    tmp_path.chmod(0o777)
    (tmp_path / "ok").chmod(0o777)
    (tmp_path / "ok" / "model.py").chmod(0o666)
    (tmp_path / "closed").chmod(0o000)
    demote = None
    if os.geteuid() == 0:
        if not _reachable_by_nobody(tmp_path):
            pytest.skip("the temporary folder is not reachable by an unprivileged user here")
        demote = _as_nobody
    try:
        result = subprocess.run([sys.executable, "-m", "annot.cli", "rewrite", "--target", "torch", str(tmp_path)],
                                capture_output=True, text=True, timeout=120, preexec_fn=demote,
                                cwd=Path(__file__).resolve().parents[2],
                                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    finally:
        (tmp_path / "closed").chmod(0o755)
    assert result.returncode == 2, result.stderr
    assert "closed: cannot read this folder" in result.stderr, result.stderr
    assert "checkpoint" in (tmp_path / "ok" / "model.py").read_text()  # the rest is still done


def _as_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


def _reachable_by_nobody(path: Path) -> bool:
    needed = [("-x", path), ("-r", Path(__file__)), ("-x", Path(sys.executable).resolve())]
    return all(subprocess.run(["test", flag, str(p)], preexec_fn=_as_nobody, check=False).returncode == 0
               for flag, p in needed)


def test_a_folder_the_system_refuses_to_list_is_reported(tmp_path, monkeypatch, capsys):
    """The same, with the refusal simulated at the one call that lists a folder (runs
    wherever the tests run, root included)."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "model.py").write_text(MODEL)
    (tmp_path / "closed").mkdir()
    real_scandir = os.scandir

    def scandir(path):
        if Path(path).name == "closed":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert _rewrite(str(tmp_path)) == 2
    assert "closed: cannot read this folder (Permission denied)" in capsys.readouterr().err
    assert "checkpoint" in (tmp_path / "ok" / "model.py").read_text()


def _refuse(monkeypatch, closed: Path) -> None:
    """A folder that lists but may not be looked into (read without search permission):
    every stat below it fails, and its sub-folders cannot be listed. Simulated at the two
    calls that touch it, since the tests run as root (root may look into any folder)."""
    real_stat, real_scandir = os.stat, os.scandir

    def refused(path) -> bool:
        return Path(os.fspath(path)).is_relative_to(closed) and Path(os.fspath(path)) != closed

    def stat(path, *args, **kwargs):
        if refused(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    def scandir(path):
        if refused(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_folder_that_cannot_be_looked_into_is_one_line(tmp_path, monkeypatch, capsys, jobs):
    """Its files (and a sub-folder) fail one by one; the user hears of the folder once,
    with the fix, and the other files are still rewritten (was: a PermissionError traceback)."""
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "model.py").write_text(MODEL)
    closed = tmp_path / "closed"
    (closed / "sub").mkdir(parents=True)
    for path in (closed / "a.py", closed / "b.py", closed / "sub" / "c.py"):
        path.write_text(MODEL)
    _refuse(monkeypatch, closed)
    assert _rewrite("-j", jobs, str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "closed" in line] == [
        f"annot rewrite: error: {closed}: cannot read this folder (Permission denied); make it "
        "readable for this user (chmod u+rx) or leave it out with --exclude"
    ]
    assert "checkpoint" in (tmp_path / "ok" / "model.py").read_text()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_unreadable_file_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys, jobs):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "secret.py").write_text(MODEL)
    real_read_bytes = Path.read_bytes

    def read_bytes(self):
        if self.name == "secret.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)  # forked workers (-j 2) inherit it
    assert _rewrite("-j", jobs, str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "secret.py" in line] == [
        f"{tmp_path}/secret.py:1:1: cannot read this file (Permission denied); make it readable "
        "for this user or leave it out with --exclude"
    ]
    assert "checkpoint" in (tmp_path / "model.py").read_text()


def _dies_on_secret(job):
    """A worker that ends without an answer on one file, as a crash in native code does."""
    from annot.rewriter import cli

    if job.path.endswith("secret.py"):
        os._exit(1)
    return cli._process_original(job)


def test_a_worker_that_dies_is_one_line(tmp_path, monkeypatch, capsys):
    """A broken process pool was a traceback; now one line naming what was not processed."""
    from annot.rewriter import cli

    (tmp_path / "a.py").write_text(MODEL)
    (tmp_path / "secret.py").write_text(MODEL)
    monkeypatch.setattr(cli, "_process_original", cli._process, raising=False)
    monkeypatch.setattr(cli, "_process", _dies_on_secret)  # forked workers inherit it
    assert _rewrite("-j", "2", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # One error line (the folder's name holds "worker" too, and a.py may finish first).
    lines = [line for line in err.splitlines() if line.startswith("annot rewrite: error")]
    assert len(lines) == 1, err
    [line] = lines
    assert line.startswith("annot rewrite: error: a worker process ended without an answer (")
    assert line.endswith(": run again with -j 1 to see which file ends it")
