"""The README and every guide under docs/guides/ run as written: each page's ```python
blocks, in order, in one process of its own (so each page must carry its own imports and
setup)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
#: Every page whose python blocks run, relative to the repository root.
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in GUIDES.glob("*.md")
    if re.search(r"^```python\n", p.read_text(), flags=re.M)
)
#: What a page's run must print, beyond exiting 0: the lines that show its blocks did what
#: the page says (an error printed on purpose, a model trained by each trainer).
EXPECTED_OUTPUT = {
    "README.md": ["Plan for GPT", "loss after 3 steps:", "llama, 3 steps: loss"],
    "docs/guides/plan-and-policies.md": ["tied parameters are split across shard units"],
    "docs/guides/engines.md": ["loss after 3 steps:", "moe: model.layers.[0-1].mlp",
                               "refused: ParallelDims(replicate=1, shard=-1, tp=1, ep=2)"],
    "docs/guides/huggingface.md": ["LlamaDecoderLayer", "llama, 3 steps: loss", "froze",
                                   "Plan for FluxTransformer2DModel", "flux, 3 steps: loss",
                                   "diffusion_pytorch_model.safetensors"],
    "docs/guides/trainers.md": ["LlamaDecoderLayer", "lightning, 3 steps: loss",
                                "hf trainer, 3 steps: loss"],
    "docs/guides/multi-node.md": ["parallel:", "is not a multiple of 3"],
    "docs/guides/trust.md": ["overlaps"],
    "docs/guides/float8-and-compile.md": ["shard,checkpoint,float8(rowwise x4),compile"],
}


def python_blocks(text: str) -> list[str]:
    # ```python blocks run; ```python skip blocks are fragments shown for reading.
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^```bash\n(.*?)\n```", text, flags=re.S | re.M)[:2]
    assert "pip install -e '.[all,test]'" in commands[0] and "annot plan" in commands[0]
    assert "pytest" in commands[1]


def test_the_readme_fits_a_few_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_guide_is_linked_from_the_index_and_the_readme():
    index = (GUIDES / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    guides = sorted(p.name for p in GUIDES.glob("*.md") if p.name != "README.md")
    assert len(guides) >= 10
    assert [g for g in guides if f"]({g})" not in index] == []
    assert [g for g in guides if f"](docs/guides/{g})" not in readme] == []


def test_expected_outputs_name_pages_that_run():
    # A renamed or emptied page must not drop its output checks silently.
    assert sorted(set(EXPECTED_OUTPUT) - set(PAGES)) == []


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
    blocks = python_blocks((ROOT / page).read_text())
    assert blocks, f"{page} has no python block"
    script = tmp_path / "page.py"
    script.write_text("\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    missing = [line for line in EXPECTED_OUTPUT.get(page, []) if line not in result.stdout]
    assert missing == [], result.stdout
