"""Calls left alone, each with the reason reported, for both targets."""

from __future__ import annotations

import pytest

IMPORTS = """\
import functools

import torch
import torch.utils.checkpoint as cp
from torch import nn

from annot import checkpoint_block
"""


@pytest.fixture
def header(net_source) -> str:
    return net_source(IMPORTS)


def _skip_reasons(rewrite, header, body: str, target: str, **options: object) -> list[str]:
    source = header + body
    result = rewrite(source, target, **options)
    assert result.code == source, "a not-wrapped case must leave the file unchanged"
    assert not result.wrapped
    return [s.reason for s in result.skipped]


@pytest.mark.parametrize(
    "call",
    [
        "x = cp.checkpoint(block, x, use_reentrant=False)",
        "x = torch.utils.checkpoint.checkpoint(block, x)",
        "x = self._gradient_checkpointing_func(block.__call__, x)",
    ],
)
def test_already_checkpointed_call(rewrite, target, call, header) -> None:
    body = f"        for block in self.h:\n            {call}\n        return x\n"
    [reason] = _skip_reasons(rewrite, header, body, target)
    assert reason.startswith("already checkpointed by")


def test_deepspeed_checkpoint_under_an_alias(rewrite, target, header) -> None:
    source = (
        "import deepspeed as ds\n"
        + header
        + (
            "        for block in self.h:\n"
            "            x = ds.checkpointing.checkpoint(block, x)\n"
            "        return x\n"
        )
    )
    result = rewrite(source, target)
    assert result.code == source
    assert [s.reason for s in result.skipped] == [
        "already checkpointed by deepspeed.checkpointing.checkpoint"
    ]


def test_checkpoint_sequential_on_the_trunk(rewrite, target, header) -> None:
    body = "        return cp.checkpoint_sequential(self.seq, 2, x, use_reentrant=False)\n"
    assert _skip_reasons(rewrite, header, body, target) == [
        "already checkpointed by torch.utils.checkpoint.checkpoint_sequential"
    ]


def test_timm_checkpoint_seq(rewrite, target, header) -> None:
    source = (
        "from timm.models._manipulate import checkpoint_seq\n"
        + header
        + ("        return checkpoint_seq(self.seq, x)\n")
    )
    result = rewrite(source, target)
    assert result.code == source
    assert result.skipped[0].reason.startswith("already checkpointed by timm")


def test_non_checkpoint_branch_of_an_existing_guard(rewrite, target, header) -> None:
    body = (
        "        for block in self.h:\n"
        "            if self.gradient_checkpointing and self.training:\n"
        "                x = self._gradient_checkpointing_func(block.__call__, x)\n"
        "            else:\n"
        "                x = block(x)\n"
        "        return x\n"
    )
    reasons = _skip_reasons(rewrite, header, body, target)
    assert "the other branch of this `if` already checkpoints it" in reasons


def test_user_function_named_checkpoint(rewrite, target, header) -> None:
    source = header.replace("import functools\n", "def checkpoint(f, x):\n    return f(x)\n") + (
        "        for block in self.h:\n            x = checkpoint(block, x)\n        return x\n"
    )
    result = rewrite(source, target)
    assert result.code == source
    [skip] = result.skipped
    assert "not a known checkpoint function" in skip.reason


def test_comprehension_is_opt_in(rewrite, target, header) -> None:
    body = "        return [block(x) for block in self.h]\n"
    [reason] = _skip_reasons(rewrite, header, body, target)
    assert reason == "inside a comprehension; opt in with --functional"


def test_reduce_is_opt_in(rewrite, target, header) -> None:
    body = "        return functools.reduce(lambda h, block: block(h), self.h, x)\n"
    [reason] = _skip_reasons(rewrite, header, body, target)
    assert reason == "inside a lambda (functools.reduce form); opt in with --functional"


def test_reduce_is_wrapped_with_functional(rewrite, target, header) -> None:
    body = "        return functools.reduce(lambda h, block: block(h), self.h, x)\n"
    result = rewrite(header + body, target, functional=True)
    assert len(result.wrapped) == 1
    # the loop variable `block` and the running value `h` are bound when the call is made
    assert ("lambda block=block, h=h: block(h)" if target == "deepspeed" else "checkpoint(block, h") in (
        result.code
    )


def test_loop_that_does_not_call_the_block(rewrite, target, header) -> None:
    body = "        for block in self.h:\n            print(block)\n        return x\n"
    result = rewrite(header + body, target)
    assert [(s.block, s.reason) for s in result.skipped] == [
        ("loop over self.h", "the loop does not call its element")
    ]


def test_call_on_the_line_of_its_for(rewrite, target, header) -> None:
    body = "        for block in self.h: x = block(x)\n        return x\n"
    [reason] = _skip_reasons(rewrite, header, body, target)
    assert "put it on its own line" in reason


def test_deepspeed_function_keyword_reaches_the_block(header) -> None:
    """DeepSpeed's non-reentrant checkpoint takes no keywords: they stay in the lambda's
    call of the block, so a keyword named like its parameter (`function=`) is the block's."""
    from annot.rewriter import rewrite_source

    source = (
        header
        + "        for block in self.h:\n            x = block(x, function=1)\n        return x\n"
    )
    result = rewrite_source(source, target="deepspeed", blocks={"Block"})
    assert "non_reentrant_checkpoint(lambda block=block, x=x: block(x, function=1))" in result.code


def test_unmarked_class_is_not_wrapped_when_marks_exist(rewrite, target, header) -> None:
    source = header.replace(
        "self.h = nn.ModuleList([Block()", "self.h = nn.ModuleList([nn.Linear(2, 2)"
    )
    source += "        for layer in self.h:\n            x = layer(x)\n        return x\n"
    result = rewrite(source, target)
    assert result.code == source
    # never silent: the loop is reported with why nothing in it was wrapped
    assert [s.reason for s in result.skipped] == ["elements are Linear, none of the selected classes"]


def test_skip_is_reported_at_its_line(rewrite, target, header) -> None:
    body = "        for block in self.h:\n\n            # no call here\n            print(block)\n"
    [skip] = rewrite(header + body, target).skipped
    assert (skip.line, skip.column) == (header.count("\n") + 1, 13)
