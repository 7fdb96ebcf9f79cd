"""``annot rewrite`` (rewriter.cli.main): files, modes, exit codes, output."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from annot.rewriter.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SRC = (GOLDEN / "loop_positional.py").read_text(encoding="utf-8")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "pkg" / "model.py"
    path.parent.mkdir()
    path.write_text(SRC, encoding="utf-8")
    return path


def test_rewrites_in_place(model: Path) -> None:
    assert main([str(model), "-q"]) == 0
    assert model.read_text() == (GOLDEN / "loop_positional.deepspeed.expected").read_text()


def test_target_torch(model: Path) -> None:
    assert main([str(model), "-q", "--target", "torch"]) == 0
    assert model.read_text() == (GOLDEN / "loop_positional.torch.expected").read_text()


def test_check_exits_1_and_writes_nothing(model: Path) -> None:
    assert main([str(model), "--check", "-q"]) == 1
    assert model.read_text() == SRC


def test_check_exits_0_when_nothing_to_do(model: Path) -> None:
    main([str(model), "-q"])
    assert main([str(model), "--check", "-q"]) == 0


def test_diff_prints_a_unified_diff(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model), "--diff", "-q"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"--- {model}\n+++ {model}\n")
    assert "+import deepspeed  # annot: import\n" in out
    assert model.read_text() == SRC


def test_undo_restores_the_bytes(model: Path) -> None:
    main([str(model), "-q"])
    assert main([str(model), "--undo", "-q"]) == 0
    assert model.read_text() == SRC


def test_directory_is_recursive_and_exclude_skips(model: Path) -> None:
    other = model.parent / "sub" / "skipme.py"
    other.parent.mkdir()
    other.write_text(SRC)
    assert main([str(model.parent), "--exclude", "sub/*", "-q"]) == 0
    assert other.read_text() == SRC
    assert model.read_text() != SRC


def test_blocks_option_selects_classes(model: Path) -> None:
    source = SRC.replace("@checkpoint_block\n", "")
    model.write_text(source)
    assert main([str(model), "--blocks", "Block", "--check", "-q"]) == 1


def test_marks_resolve_across_files(tmp_path: Path) -> None:
    (tmp_path / "blocks.py").write_text(
        "from torch import nn\nfrom annot import checkpoint_block\n\n"
        "@checkpoint_block\nclass Block(nn.Module):\n    pass\n"
    )
    net = tmp_path / "net.py"
    net.write_text(
        "from torch import nn\nfrom blocks import Block as B\n\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a = B()\n        self.b = nn.Linear(2, 2)\n\n"
        "    def forward(self, x):\n        return self.b(self.a(x))\n"
    )
    assert main([str(tmp_path), "-q"]) == 0
    assert "deepspeed.checkpointing.non_reentrant_checkpoint(lambda _block=self.a, x=x: _block(x))" in (
        net.read_text()
    )


def test_parse_error_is_reported_and_others_processed(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = model.parent / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    assert main([str(model.parent), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:1: " in err
    assert bad.read_text() == "def f(:\n    pass\n"
    assert model.read_text() != SRC


def test_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    assert main([str(tmp_path / "nope.py")]) == 2


def test_bad_option_is_a_usage_error() -> None:
    assert main(["--target", "jax", "x.py"]) == 2


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--target", "jax", "x.py"], "argument --target: invalid choice: 'jax'"),
        ([], "the following arguments are required: PATH"),
        (["-j", "0", "x.py"], "-j must be at least 1, got 0"),
        (["-j", "two", "x.py"], "argument -j/--jobs: invalid int value: 'two'"),
    ],
)
def test_a_usage_error_is_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("annot rewrite: error: ") and says in err, err


def test_permissions_are_kept(model: Path) -> None:
    model.chmod(0o640)
    main([str(model), "-q"])
    assert model.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in model.parent.iterdir()] == ["model.py"]  # no temporary left


def test_latin1_file_keeps_its_encoding(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    source = "# -*- coding: latin-1 -*-\n# caf\xe9\n" + SRC
    path.write_bytes(source.encode("latin-1"))
    assert main([str(path), "-q"]) == 0
    assert path.read_bytes().decode("latin-1").startswith("# -*- coding: latin-1 -*-\n# caf\xe9\n")


@pytest.mark.slow
def test_two_workers_give_the_same_result(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"m{i}.py").write_text(SRC)
    assert main([str(tmp_path), "-j", "2", "-q"]) == 0
    expected = (GOLDEN / "loop_positional.deepspeed.expected").read_text()
    assert all((tmp_path / f"m{i}.py").read_text() == expected for i in range(4))


def test_summary_and_deepspeed_snippet(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(model)])
    err = capsys.readouterr().err
    assert "1 file(s) changed, 0 unchanged, 0 failed; 1 site(s) wrapped, 0 skipped" in err
    assert "deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)" in err
    assert 'checkpoint calls per forward (for "number_checkpoints"):\n  Net.forward: n' in err


def test_verbose_lists_every_site(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(model), "-v", "--check"])
    assert f"{model}:21:17: wrapped block(...) in Net.forward" in capsys.readouterr().err


def test_help_imports_neither_torch_nor_libcst() -> None:
    """`annot rewrite --help` stays light: what makes it slow (torch, libcst) is not
    imported (counted by module, not timed)."""
    code = (
        "import sys\n"
        "from annot.rewriter.cli import main\n"
        "assert main(['--help']) == 0\n"
        "assert 'torch' not in sys.modules and 'libcst' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)


def test_annot_console_script_help() -> None:
    annot = shutil.which("annot") or os.path.join(os.path.dirname(sys.executable), "annot")
    proc = subprocess.run([annot, "rewrite", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--undo" in proc.stdout


def test_blocks_that_match_nothing_are_reported(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model), "--blocks", "Nope", "-q"]) == 0
    assert "warning: --blocks Nope: no forward calls these classes" in capsys.readouterr().err
    assert model.read_text() == SRC


UNPROTECTED = """\
from torch import nn


class Block(nn.Module):
    def forward(self, x):
        return x


class Helper(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])

    def forward(self, x):
        for layer in self.mlp:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def encode(self, x):
        return [block(x) for block in self.blocks]
"""


def test_a_file_with_nothing_wrapped_says_why_per_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "net.py"
    path.write_text(UNPROTECTED)
    assert main([str(path), "--check"]) == 0  # nothing would change; trunk mode
    err = capsys.readouterr().err
    assert f"{path}:15:13: skipped loop over self.mlp in Helper.forward: elements are torch.nn" in err
    assert f"{path}:26:17: skipped block in Net.encode: inside a comprehension" in err


def test_check_fails_where_a_selected_block_cannot_be_wrapped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "net.py"
    path.write_text(UNPROTECTED)
    assert main([str(path), "--check", "--blocks", "Block"]) == 1
    err = capsys.readouterr().err
    assert "error: selected blocks called where they cannot be wrapped:" in err
    assert f"{path}:26:17: block in Net.encode: inside a comprehension" in err
    assert path.read_text() == UNPROTECTED


def test_blocks_match_calls_in_any_method(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    path.write_text(UNPROTECTED.replace(
        "        return [block(x) for block in self.blocks]\n",
        "        for block in self.blocks:\n            x = block(x)\n        return x\n",
    ))
    assert main([str(path), "-q", "--blocks", "Block", "--target", "torch"]) == 0
    assert "x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)" in (
        path.read_text()
    )
