"""``python -m annot.verify``: the command on the CPU, its result without a GPU, how a row
that fails or raises shows, and that a row compares for real (a perturbed model fails)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from annot.verify import command
from annot.verify.result import fail_unless
from tests.distributed import ROOT, run_process, worker_env

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the result without a CUDA device")
CPU_ROWS = {name for name, _, needs_cuda in command.ROWS if not needs_cuda}


@pytest.mark.slow
def test_the_cpu_command_passes_every_cpu_row_and_skips_the_gpu_rows(tmp_path):
    out = tmp_path / "verify.json"
    proc = run_process([sys.executable, "-m", "annot.verify", "--device", "cpu", "--out", str(out)],
                       env=worker_env(), cwd=ROOT, timeout=600, merge_stderr=False)
    assert proc.returncode == command.EXIT_OK, proc.stdout + proc.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {name for name, _, _ in command.ROWS}
    assert {n: rows[n]["status"] for n in CPU_ROWS} == dict.fromkeys(CPU_ROWS, "pass")
    if not torch.cuda.is_available():
        gpu_rows = rows.keys() - CPU_ROWS
        assert {rows[n]["status"] for n in gpu_rows} == {"skipped"}
        assert all(rows[n]["reason"].startswith("no CUDA device (found: torch") for n in gpu_rows)
    assert "| fsdp2_parity_fp32 | pass |" in proc.stdout  # the printed table


@NO_CUDA
def test_cuda_without_a_gpu_skips_every_row_writes_the_file_and_exits_3(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert command.main(["--device", "cuda", "--out", str(out)]) == command.EXIT_NO_CUDA == 3
    report = json.loads(out.read_text())
    assert len(report["rows"]) == len(command.ROWS)
    assert {row["status"] for row in report["rows"]} == {"skipped"}
    assert all(row["reason"].startswith("no CUDA device (found: torch") for row in report["rows"])
    assert "nothing was verified" in capsys.readouterr().out


def _row_table(monkeypatch, *rows):
    monkeypatch.setattr(command, "ROWS", [(fn.__name__, fn, False) for fn in rows])


def _passes(ctx):
    return fail_unless("_passes", True, "always")


def _fails(ctx):
    return fail_unless("_fails", False, "never", figure=1.5)


def _raises(ctx):
    raise RuntimeError("boom")


@pytest.mark.parametrize("rows, status", [((_passes,), 0), ((_passes, _fails), 1), ((_raises, _passes), 1)],
                         ids=["pass", "fail", "error"])
def test_the_exit_status_is_1_when_a_row_fails_or_raises_and_the_others_still_run(
        monkeypatch, tmp_path, rows, status):
    monkeypatch.setattr(command.Context, "start_group", lambda self: None)
    _row_table(monkeypatch, *rows)
    out = tmp_path / "verify.json"
    assert command.main(["--device", "cpu", "--out", str(out)]) == status
    written = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in written] == [fn.__name__ for fn in rows]
    errors = [r for r in written if r["status"] == "error"]
    assert all(r["reason"] == "RuntimeError: boom" and "boom" in r["traceback"] for r in errors)


def test_an_unknown_row_name_is_a_usage_error_naming_the_rows(tmp_path, capsys):
    assert command.main(["--device", "cpu", "--out", str(tmp_path / "x.json"), "--rows", "nope"]) == 2
    assert "no row named nope; the rows are" in capsys.readouterr().err


@pytest.mark.slow
def test_the_parity_row_fails_when_the_sharded_model_differs(monkeypatch):
    """The row compares for real: auto_wrap returning a model with one value nudged by
    1e-4 (above the 1e-6 bound) makes it fail."""
    import annot.verify.training as training

    real = training.auto_wrap

    def nudged(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).to_local().add_(1e-4)  # FSDP2: a DTensor
        return result

    monkeypatch.setattr(training, "auto_wrap", nudged)
    [row] = command.run_rows("cpu", ["fsdp2_parity_fp32"])
    assert row["status"] == "fail" and row["max_param_diff"] > 1e-6, row


@pytest.mark.parametrize(("ranks_on_node", "backend"), [("1", "cpu:gloo,cuda:nccl"), ("2", "gloo")])
def test_the_rows_join_the_group_annot_devices_chooses(monkeypatch, ranks_on_node, backend):
    """The world-one group is `annot.init_distributed`'s, with `distributed_backend`'s
    choice (one GPU mocked; two ranks on it are NCCL's refusal, so gloo)."""
    from annot.verify import context

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # What start_group would set for torchrun, set here so that the test restores it.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_WORLD_SIZE", ranks_on_node), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    joined = []
    monkeypatch.setattr(context, "init_distributed",
                        lambda backend, **kw: joined.append((backend, kw["device"])))
    context.Context(torch.device("cuda", 0)).start_group()
    assert joined == [(backend, torch.device("cuda", 0))]
