"""Every byte outside the wrapped statements is kept; wrapped calls keep their layout."""

from __future__ import annotations

from annot.rewriter import rewrite_source, undo_source

MODEL = """\
# -*- coding: utf-8 -*-
import torch  # a comment
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(2) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:


            # a comment before the call, and blank lines
            x = layer(x)  # trailing comment
        return x
"""


def _round_trip(source: str) -> tuple[str, str]:
    new = rewrite_source(source).code
    return new, undo_source(new).code


def test_crlf_line_endings_are_kept() -> None:
    source = MODEL.replace("\n", "\r\n")
    new, back = _round_trip(source)
    assert "\n" not in new.replace("\r\n", "")
    assert back == source


def test_bom_is_kept() -> None:
    source = "\ufeff" + MODEL
    new, back = _round_trip(source)
    assert new.startswith("\ufeff# -*- coding")
    assert back == source


def test_tabs_are_kept() -> None:
    source = MODEL.replace("    ", "\t")
    new, back = _round_trip(source)
    assert "    " not in new
    assert back == source


def test_comments_and_blank_lines_are_kept() -> None:
    new, _ = _round_trip(MODEL)
    assert (
        "\n\n\n            # a comment before the call, and blank lines\n            if self.training"
        in new
    )
    assert (
        "x = deepspeed.checkpointing.non_reentrant_checkpoint(lambda layer=layer, x=x: layer(x))"
        "  # trailing comment\n"
    ) in new


def test_only_the_wrapped_statement_and_the_import_change() -> None:
    new, _ = _round_trip(MODEL)
    old_lines, new_lines = MODEL.splitlines(), new.splitlines()
    assert [line for line in new_lines if line not in old_lines] == [
        "import deepspeed  # annot: import",
        "            if self.training and torch.is_grad_enabled():  # annot: checkpoint",
        "                x = deepspeed.checkpointing.non_reentrant_checkpoint("
        "lambda layer=layer, x=x: layer(x))  # trailing comment",
        "            else:",
        "                x = layer(x)  # trailing comment",
    ]


def test_one_argument_per_line_layout_is_kept() -> None:
    source = MODEL.replace(
        "x = layer(x)  # trailing comment", "x = layer(\n                x,\n            )"
    )
    new = rewrite_source(source, target="torch").code
    assert (
        "x = torch.utils.checkpoint.checkpoint(\n"
        "                    layer,\n"
        "                    x,\n"
        "                    use_reentrant=False,\n"
        "                )\n"
    ) in new
