"""A one-line progress report on stderr: rank 0 only, and only on a terminal."""

from __future__ import annotations

import sys

import torch


class Progress:
    """``with Progress("loading", total) as p: ... p.advance()``; silent unless shown."""

    def __init__(self, label: str, total: int, *, show: bool | None = None) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.show = _default_show() if show is None else show
        self._last = -1

    def __enter__(self) -> Progress:
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        percent = 100 * self.done // self.total
        if self.show and percent != self._last:
            self._last = percent
            print(f"\r{self.label}: {percent:3d}% ({self.done}/{self.total})", end="",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.show and self._last >= 0:
            print(file=sys.stderr, flush=True)


def _default_show() -> bool:
    if not sys.stderr.isatty():
        return False
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
