"""What the sweeps' drivers share (the causal-LM sweep, tests/huggingface/sweep_causal_lm.py,
and the class sweep, tests/huggingface/sweep_classes.py): the row file, the folders of
prepared architectures, the single-process stage's loop, the torchrun launches that
loop over many architectures, and the markdown tables.

A row is one JSON object a line, named by its ``key`` field (``arch`` in the causal-LM
sweep, ``case`` = ``class/architecture`` in the class sweep, where one model type can
stand in two mappings); the last row of a name wins. A worker (sweep_worker.py's `serve`)
appends a row as each architecture ends and writes the name it starts into
``ROWS.current``, so a launch that dies says where; the next launch starts after it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.huggingface.sweep_worker import GRAD_ATOL, LOSS_RTOL, PREPARED

if TYPE_CHECKING:
    import pytest

Row = dict[str, Any]
Rows = dict[str, Row]
OUTCOMES = ("pass", "refused", "skipped", "failing")
LAUNCH_TIMEOUT_S = 3600
# A launch past its budget is given this long to finish the architecture it is in.
LAUNCH_GRACE_S = 900


def read_rows(path: Path, key: str = "arch") -> Rows:
    """The rows in ``path`` by their ``key`` field (the last row of one wins)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row[key]: row for row in rows}


def append_row(path: Path, row: Row) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def died_row(name: str, output: str, key: str = "arch") -> Row:
    """The failing row of the architecture ``name`` a launch died in, with the last
    lines it printed."""
    tail = [line for line in output.splitlines() if line.strip()][-6:]
    return {key: name, "outcome": "failing",
            "reason": "the launch died while running it: " + " | ".join(tail)[-600:]}


#: The mark a prepare leaves in its folder until its row is written.
PREPARING = "preparing"


def prepared_root(out: Path) -> Path:
    """Where the prepared models and rows of the sweep writing ``out`` live."""
    return out.with_name(out.name + ".prepared")


def forget(out: Path, names: Iterable[str], key: str = "arch") -> None:
    """Drop the rows and prepared folders of ``names`` (``--rerun``)."""
    names = set(names)
    if out.exists():
        kept = [line for line in out.read_text().splitlines()
                if line.strip() and json.loads(line)[key] not in names]
        out.write_text("".join(f"{line}\n" for line in kept))
    for name in names:
        shutil.rmtree(prepared_root(out) / name, ignore_errors=True)


def prepare_all(names: list[str], root: Path, prepare: Callable[[str, Path], Row],
                budget_s: float = float("inf"), key: str = "arch") -> None:
    """``prepare(name, root / name)`` (the single-process stage) for every name not
    prepared under ``root`` yet, until ``budget_s`` seconds have passed; its row goes
    into ``root / name / PREPARED``. An architecture that ends here (its row has an
    outcome) keeps only its row. One the stage's process died on (a native crash in
    the interpreter: it left its ``PREPARING`` mark and no row) is recorded as failing
    when the next run meets it, rather than crashing that run too; ``--rerun`` retries."""
    start = time.monotonic()
    for name in names:
        directory = root / name
        if (directory / PREPARED).exists():
            continue
        if time.monotonic() - start > budget_s:
            return
        if (directory / PREPARING).exists():
            row: Row = {key: name, "outcome": "failing",
                        "reason": "the single-process stage's process died while preparing "
                                  "it (a previous run; --rerun to try again)"}
        else:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            (directory / PREPARING).touch()
            began = time.monotonic()
            row = prepare(name, directory)
            row["prepare_seconds"] = round(time.monotonic() - began, 1)
        if row["outcome"] is not None:
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / PREPARING).unlink(missing_ok=True)
        (directory / PREPARED).write_text(json.dumps(row))
        print(f"prepared {name}: {row['outcome'] or 'to train'} {row.get('reason', '')[:160]}", flush=True)


def _keep_only_rows(root: Path, done: Iterable[str]) -> None:
    """A finished architecture needs only its row: its model and reference go."""
    for name in done:
        for item in (root / name).glob("*"):
            if item.name != PREPARED:
                shutil.rmtree(item) if item.is_dir() else item.unlink()


def train_all(names: list[str], out: Path, worker: Path, budget_s: float = float("inf"),
              key: str = "arch") -> Rows:
    """The 2-rank stage (``worker`` under torchrun) of the prepared names of ``names``
    that ``out`` has no row for, in as many launches as it takes (a launch that dies
    records the name it was running as failing, and the next starts after it), until
    ``budget_s`` seconds of launches have passed. Returns every row of ``out``."""
    from tests.distributed import torchrun

    root = prepared_root(out)
    start = time.monotonic()
    while True:
        done = read_rows(out, key)
        _keep_only_rows(root, done)
        todo = [n for n in names if n not in done and (root / n / PREPARED).exists()]
        left = budget_s - (time.monotonic() - start)
        if not todo or left <= 0:
            return done
        try:
            proc = torchrun(worker, str(out), str(root), str(left), *todo,
                            timeout=min(LAUNCH_TIMEOUT_S, left + LAUNCH_GRACE_S), check=False)
            output, failed = proc.stdout, proc.returncode != 0
        except TimeoutError as error:
            output, failed = str(error), True
        current = Path(f"{out}.current")
        if failed and current.exists():
            append_row(out, died_row(current.read_text().strip(), output, key))
            current.unlink()
        elif failed:
            raise RuntimeError(f"the sweep's launch failed before any architecture:\n{output[-4000:]}")


def run_stages(names: list[str], out: Path, prepare: Callable[[str, Path], Row], worker: Path,
               budget_s: float = float("inf"), stages: tuple[str, ...] = ("prepare", "train"),
               key: str = "arch") -> Rows:
    """Both stages (or those named) for ``names``, rows into ``out``; every row of it."""
    start = time.monotonic()
    if "prepare" in stages:
        done = read_rows(out, key)
        prepare_all([n for n in names if n not in done], prepared_root(out), prepare, budget_s, key)
    if "train" in stages:
        return train_all(names, out, worker, budget_s - (time.monotonic() - start), key)
    return read_rows(out, key)


# -- tables

ReasonClasses = tuple[tuple[str, str], ...]
#: Reason classes both sweeps' rows have: annot's refusals of a converted checkpoint
#: (first: they are the most specific), and the 2-rank stage's and the plan commands'
#: failures (last). Each sweep puts its own between them.
CONVERSION_REASONS: ReasonClasses = (
    ("MoE conversion (moe-load)", "MoE conversion (moe-load)"),
    ("converted checkpoint", "converted checkpoint:"),
)
RUN_REASONS: ReasonClasses = (
    ("annot plan DIR --memory", "annot plan DIR --memory"),
    ("annot plan DIR", "annot plan DIR exited"),
    ("silent difference", "silent difference"),
    ("crash", "crash:"),
    ("the launch died", "the launch died"),
)


def reason_class(row: Row, classes: ReasonClasses) -> str:
    """The class of a row's reason: the first of ``classes`` (name, words) whose words
    the reason holds, or the reason itself (its first 80 characters)."""
    reason = row.get("reason", "")
    return next((name for name, words in classes if words in reason), reason[:80])


def outcome_table(rows: Rows, group: Callable[[Row], str], label: str) -> str:
    """A markdown table: the count per outcome of each group (``label`` heads the group
    column), in the order the groups first occur, and the total."""
    by: dict[str, collections.Counter[str]] = {}
    for row in rows.values():
        by.setdefault(group(row), collections.Counter())[row["outcome"]] += 1
    lines = [f"| {label} | " + " | ".join(OUTCOMES) + " | total |", "|---|" + "---:|" * (len(OUTCOMES) + 1)]
    for name, count in by.items():
        lines.append(f"| {name} | " + " | ".join(str(count.get(o, 0)) for o in OUTCOMES)
                     + f" | {sum(count.values())} |")
    return "\n".join(lines)


def by_reason(rows: Rows, classes: ReasonClasses, group: Callable[[Row], str] | None = None,
              name: Callable[[str], str] = str) -> str:
    """A markdown table: outcome, reason class, count and the architectures (each as
    ``name(key)``); with ``group``, one row per group too (its column first)."""
    groups: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    for key, row in sorted(rows.items()):
        reason = reason_class(row, classes) if row["outcome"] != "pass" else ""
        groups[(group(row) if group else "", row["outcome"], reason)].append(name(key))
    head = ["outcome", "reason", "count", "architectures"]
    lines = [f"| {' | '.join((['class'] if group else []) + head)} |",
             "|" + "---|" * (len(head) - 2 + bool(group)) + "---:|---|"]
    order = {outcome: i for i, outcome in enumerate(OUTCOMES)}
    for (kind, outcome, reason), names in sorted(groups.items(), key=lambda g: (g[0][0], order[g[0][1]], g[0][2])):
        cells = ([kind] if group else []) + [outcome, reason, str(len(names)), ", ".join(names)]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def reasons(rows: Rows) -> str:
    """Every row that did not pass, by outcome: ``name: reason``."""
    lines = []
    for outcome in OUTCOMES[1:]:
        for key, row in sorted(rows.items()):
            if row["outcome"] == outcome:
                lines.append(f"{outcome:8} {key}: {row.get('reason', '')[:240]}")
    return "\n".join(lines)


# -- the command line


def sweep_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every sweep's script takes: --out, --only, --budget, --rerun, --stage."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, required=True, help="rows, one JSON object a line")
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds of launches in this call (the rest in a later one)")
    parser.add_argument("--rerun", action="store_true", help="run --only again even if --out has them")
    parser.add_argument("--stage", choices=("prepare", "train", "all"), default="all",
                        help="prepare: the single-process stage only (no launch); train: the "
                             "2-rank launches of what is prepared; all: both (default)")
    return parser


def stages_of(stage: str) -> tuple[str, ...]:
    """The stages ``--stage`` names."""
    return ("prepare", "train") if stage == "all" else (stage,)


def print_report(rows: Rows, names: list[str], tables: list[str]) -> None:
    """Every reason, the tables, and the names of ``names`` not run yet."""
    print(reasons(rows))
    for table in tables:
        print()
        print(table)
    missing = [n for n in names if n not in rows]
    if missing:
        print(f"\nnot run yet ({len(missing)}): {', '.join(missing)}")


# -- the sweep tests

#: A file of rows the sweep tests read and extend instead of running into a temporary folder.
ROWS_VARIABLE = "ANNOT_SWEEP_ROWS"


def sweep_selection(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   test_name: str, param: str) -> tuple[list[str], Path]:
    """What a sweep test's fixture runs the driver on: the values of ``param`` of the
    session's items of ``test_name`` (those ``-k`` left), and the row file
    (``ANNOT_SWEEP_ROWS``, else a fresh temporary one)."""
    selected = [item.callspec.params[param] for item in request.session.items
                if getattr(item, "originalname", "") == test_name]
    given = os.environ.get(ROWS_VARIABLE)
    return selected, Path(given) if given else tmp_path_factory.mktemp("sweep") / "rows.jsonl"


def check_row(row: Row, labels: Iterable[str], name: str) -> str | None:
    """The sweep tests' check of the row of ``name``: None for a pass (each scenario of
    ``labels`` within `LOSS_RTOL`, and `GRAD_ATOL` past `GRAD_RTOL` of the reference;
    both plan commands exit 0) or a refusal by an annot error with its reason; a skip's reason (the test skips with it).
    Raises AssertionError for a failing row, or one that breaks those promises."""
    if row["outcome"] == "skipped":
        assert row["reason"], row
        return f"{name}: {row['reason']}"
    assert row["outcome"] != "failing", f"{name}: {row['reason']}"
    runs = [row[label] for label in labels]
    if row["outcome"] == "refused":  # the workers record only annot's errors (AnnotError) so
        refused = [run for run in runs if "refused" in run]
        assert refused and all(run["error_type"] and run["refused"] for run in refused), row
        return None
    assert row["outcome"] == "pass", row
    for run in runs:
        assert run["loss_rel"] <= LOSS_RTOL, (name, run)
        assert run.get("grad_excess", run["grad_max"]) <= GRAD_ATOL, (name, run)
    assert row["plan"]["rc"] == 0 and row["plan_memory"]["rc"] == 0, row
    return None
