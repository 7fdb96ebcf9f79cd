"""The command line of ``python -m annot.verify`` (see `annot.verify` for the exit
status) and `run_rows`, which runs the rows in order on one device."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from annot.devices import choose_device
from annot.errors import DeviceNotAvailableError
from annot.verify.context import Context, cuda_found
from annot.verify.memory import MEMORY_ROWS
from annot.verify.result import Row, run_guarded, skipped, table
from annot.verify.speed import SPEED_ROWS
from annot.verify.training import DEEPSPEED_ROWS, TRAINING_ROWS

__all__ = ["EXIT_FAILED", "EXIT_NO_CUDA", "EXIT_OK", "EXIT_USAGE", "ROWS", "main", "run_rows"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_CUDA = 0, 1, 2, 3
#: Every row, in the order they run: (name, function, needs a CUDA device).
ROWS: list[tuple[str, Callable[[Context], Row], bool]] = [*TRAINING_ROWS, *SPEED_ROWS, *MEMORY_ROWS,
                                                       *DEEPSPEED_ROWS]


def run_rows(device: str, only: Sequence[str] = (), show: Callable[[str], None] | None = None) -> list[Row]:
    """Run the rows (all, or those named in ``only``) on ``device`` (``"cpu"`` or
    ``"cuda"``); a row that needs CUDA is skipped without a CUDA device or on the CPU.
    Each row's dict gets its ``seconds``. ``show`` receives a line per finished row."""
    names = {name for name, _, _ in ROWS}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"no row named {', '.join(unknown)}; the rows are {', '.join(sorted(names))}")
    try:  # the one rule for a rank's device: LOCAL_RANK % device_count, made current
        chosen, no_cuda = choose_device(device), False
    except DeviceNotAvailableError:
        chosen, no_cuda = torch.device("cpu"), True
    ctx = Context(chosen)
    rows: list[Row] = []
    started = False
    try:
        for name, fn, needs_cuda in ROWS:
            if only and name not in only:
                continue
            start = time.perf_counter()
            if no_cuda:
                row = skipped(name, f"no CUDA device (found: {cuda_found()})")
            elif needs_cuda and not ctx.cuda:
                row = skipped(name, f"no CUDA device (found: {cuda_found()}); run with --device cuda")
            else:
                if not started:
                    ctx.start_group()
                    started = True
                ctx.fresh()
                row = run_guarded(name, lambda fn=fn: fn(ctx))  # type: ignore[misc]
            row["seconds"] = round(time.perf_counter() - start, 3)
            rows.append(row)
            if show is not None:
                show(f"{row['name']}: {row['status']} ({row['seconds']:.1f} s) {row.get('reason', '')}")
    finally:
        if started:
            ctx.stop_group()
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m annot.verify",
        description="Check annot on one device; write the rows as JSON and print a table.")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (`annot.verify`'s docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage
        return EXIT_USAGE if exc.code else EXIT_OK
    only = [n for n in args.rows.split(",") if n]
    try:
        rows = run_rows(args.device, only, show=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"python -m annot.verify: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = {"device": args.device, "found": cuda_found(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(rows))
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"\n--device cuda: no CUDA device (found: {cuda_found()}); nothing was verified "
              f"(exit {EXIT_NO_CUDA})")
        return EXIT_NO_CUDA
    failed = [r["name"] for r in rows if r["status"] in ("fail", "error")]
    counts = ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in ("pass", "fail", "error", "skipped"))
    print(f"\n{len(rows)} rows: {counts}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return EXIT_FAILED if failed else EXIT_OK
