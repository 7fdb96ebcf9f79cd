"""Helpers for the rewriter tests: rewrite a dedented snippet with the run's marks."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest

# The rewriter is libcst; a torch build without it (a GPU image) skips this folder, named.
pytest.importorskip("libcst", reason="the rewriter tests need libcst (pip install libcst)")

from annot.rewriter import RewriteResult, marked_classes, rewrite_source  # noqa: E402


def _rewrite(source: str, target: str = "deepspeed", **options: object) -> RewriteResult:
    source = textwrap.dedent(source)
    options.setdefault("blocks", marked_classes(source) or None)
    return rewrite_source(source, target=target, **options)  # type: ignore[arg-type]


@pytest.fixture
def rewrite() -> Callable[..., RewriteResult]:
    """``rewrite(snippet, target, **options)``: dedent, pick marked classes, rewrite."""
    return _rewrite


_NET = """

@checkpoint_block
class Block(nn.Module):
    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(2)])
        self.seq = nn.Sequential(*[Block() for _ in range(2)])

    def forward(self, x):
"""


def _net(imports: str, forward_body: str = "") -> str:
    return imports + _NET + forward_body


@pytest.fixture
def net_source() -> Callable[..., str]:
    """``net_source(imports, forward_body)``: a module with a marked ``Block`` and a
    ``Net`` whose ``forward(self, x)`` is ``forward_body`` (indented 8 spaces);
    ``self.h`` is a ModuleList and ``self.seq`` a Sequential of Blocks."""
    return _net


@pytest.fixture(params=["deepspeed", "torch"])
def target(request: pytest.FixtureRequest) -> str:
    return request.param
