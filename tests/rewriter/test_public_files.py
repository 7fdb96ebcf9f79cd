"""The rewriter on public model files as published (tests/rewriter/data, each with its
source in a header): what it wraps, and that what it must not wrap is reported with the
reason instead (issue #33)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from annot.rewriter import RewriteResult, rewrite_source
from annot.rewriter.cli import main

DATA = Path(__file__).parent / "data"


@functools.cache  # x-transformers is 4,500 lines: parse each file once per target
def _rewrite(name: str, target: str) -> RewriteResult:
    return rewrite_source((DATA / name).read_text(encoding="utf-8"), target=target)


def _skips_in(result: RewriteResult, function: str) -> list[tuple[str, str]]:
    return [(s.block, s.reason) for s in result.skipped if s.function == function]


def test_litgpt_wraps_the_block_loops_of_gpt_forward_only(target: str) -> None:
    result = _rewrite("litgpt_model.py", target)
    assert [(s.function, s.block) for s in result.wrapped] == [("GPT.forward", "block")] * 2


def test_litgpt_reports_the_moe_expert_loop(target: str) -> None:
    result = _rewrite("litgpt_model.py", target)
    [(block, reason)] = _skips_in(result, "LLaMAMoE.forward")
    assert block == "expert"
    assert reason == (
        "an MoE expert dispatch (`self.experts` holds MoE experts): checkpoint the layer "
        "holding the MoE, not each expert (--blocks LLaMAMLP to wrap them anyway)"
    )


def test_timm_convnext_leaves_stages_that_checkpoint_their_own_blocks(target: str) -> None:
    result = _rewrite("timm_convnext.py", target)
    assert not result.changed and not result.wrapped
    [(block, reason)] = _skips_in(result, "ConvNeXt.forward_features")
    assert block == "self.stages"
    assert reason.startswith(
        "already checkpointed inside its own class (ConvNeXtStage: `checkpoint_seq(self.blocks, x)` "
        "in ConvNeXtStage.forward, when `self.grad_checkpointing and not torch.jit.is_scripting()`)"
    )


def test_timm_convnext_reports_the_stage_loop_it_reaches_through_a_local(target: str) -> None:
    result = _rewrite("timm_convnext.py", target)
    [(block, reason)] = _skips_in(result, "ConvNeXt.forward_intermediates")
    assert block == "loop over self.stages"
    assert reason.startswith("iterates self.stages through `enumerate(stages)`; already checkpointed inside")


def test_x_transformers_reports_the_layer_loop_it_cannot_follow() -> None:
    # One target: what is reported does not depend on it, and the file takes seconds to parse.
    result = _rewrite("x_transformers.py", "torch")
    assert not result.wrapped
    [(block, reason)] = _skips_in(result, "AttentionLayers.forward")
    assert "self.layers" in block
    assert "through `enumerate(zip(*layer_variables))`, which annot cannot follow" in reason
    assert "neither wrapped nor proven safe to wrap" in reason


def test_the_cli_names_a_loop_it_cannot_follow_without_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file that gets nothing wrapped says why, loop by loop, without -v (the
    x-transformers shape, from the golden files)."""
    path = tmp_path / "model.py"
    path.write_bytes((Path(__file__).parent / "golden" / "indirect_loop.py").read_bytes())
    assert main([str(path), "--check", "-j", "1"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert f"{path}:28:13: skipped loop over self.layers in AttentionLayers.forward: iterates " \
        "self.layers through `zip(*layer_variables)`, which annot cannot follow to the block each " \
        "step calls: neither wrapped nor proven safe to wrap; loop over the container itself " \
        "(`for block in ...:`) to have it wrapped, or checkpoint at run time (annot.auto_wrap)" in lines
