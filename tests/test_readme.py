"""The README's tour runs as written: its ```python blocks, in order, in one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    # ```python blocks run; ```python skip blocks are fragments shown for reading.
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^```bash\n(.*?)\n```", text, flags=re.S | re.M)[:2]
    assert "pip install -e '.[all,test]'" in commands[0] and "annot plan" in commands[0]
    assert "pytest" in commands[1]


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path):
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4
    script = tmp_path / "tour.py"
    script.write_text("\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "tied parameters are split across shard units" in result.stdout
    assert "LlamaDecoderLayer" in result.stdout and "llama, 3 steps: loss" in result.stdout
    assert "lightning, 3 steps: loss" in result.stdout
    assert "hf trainer, 3 steps: loss" in result.stdout
