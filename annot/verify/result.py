"""A row's result: the dict every row returns, and the table the command prints."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["STATUSES", "Row", "error", "fail_unless", "result", "run_guarded", "skipped", "table"]

STATUSES = ("pass", "fail", "skipped", "error")
Row = dict[str, Any]


def result(name: str, status: str, reason: str, **figures: Any) -> Row:
    """One row: ``name``, ``status`` (one of `STATUSES`), ``reason`` and the figures."""
    if status not in STATUSES:
        raise ValueError(f"row {name!r}: status {status!r} is not one of {', '.join(STATUSES)}")
    return {"name": name, "status": status, **figures, "reason": reason}


def fail_unless(name: str, ok: bool, reason: str, **figures: Any) -> Row:
    """``pass`` when ``ok``, else ``fail``; ``reason`` says what was compared with what."""
    return result(name, "pass" if ok else "fail", reason, **figures)


def skipped(name: str, reason: str) -> Row:
    return result(name, "skipped", reason)


def error(name: str, exc: BaseException) -> Row:
    """A row that raised: the exception and the last frames of its traceback."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return result(name, "error", f"{type(exc).__name__}: {exc}", traceback="".join(frames[-4:]))


def run_guarded(name: str, fn: Callable[[], Row]) -> Row:
    """``fn()``, or the `error` row if it raised."""
    try:
        return fn()
    except Exception as exc:  # a row's failure is its result; the others still run
        return error(name, exc)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[Row]) -> str:
    """Rows as a Markdown table: name, status, figures (``key=value``), reason."""
    lines = ["| row | status | figures | reason |", "|---|---|---|---|"]
    for row in rows:
        figures = ", ".join(f"{k}={_cell(v)}" for k, v in row.items()
                            if k not in ("name", "status", "reason", "traceback"))
        reason = str(row.get("reason", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {row['name']} | {row['status']} | {figures} | {reason} |")
    return "\n".join(lines)
