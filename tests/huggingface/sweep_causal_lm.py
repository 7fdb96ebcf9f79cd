"""The causal-LM sweep (issue #29): every entry of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny config each, loaded with
``annot.from_pretrained(DIR, "fsdp2")`` on 2 CPU ranks (plain and ``checkpoint=True``)
and compared with plain single-process ``AutoModelForCausalLM.from_pretrained(DIR)``,
plus ``annot plan DIR`` and ``annot plan DIR --memory --seq 256``. Each architecture ends as one
row: ``pass``, ``refused`` (an annot error, with its reason), ``skipped`` (with its
reason: multimodal, or transformers itself fails) or ``failing`` (a crash, a silent
difference, a plan command that did not exit 0).

As a script (prints the count per outcome and the transformers version)::

    python -m tests.huggingface.sweep_causal_lm --out rows.jsonl [--only a,b] [--budget S]

Two stages (tests/huggingface/sweep_worker.py): ``prepare`` in this process (build and
save, the plain-transformers reference step, both plan commands) and ``train``, torchrun
launches on 2 ranks each looping over many architectures (annot's steps). Rows already
in ``--out`` are kept and their architectures not run again, so a long sweep runs in
chunks (``--budget``: seconds per call; ``--stage prepare`` needs no launch). The test
(test_sweep_causal_lm.py, ``-m sweep``) runs the same driver.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("sweep_worker.py")
OUTCOMES = ("pass", "refused", "skipped", "failing")
LAUNCH_TIMEOUT_S = 3600


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM head, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The rows in ``path`` by architecture (the last row of one wins)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["arch"]: row for row in rows}


def _died_row(arch: str, output: str) -> dict[str, Any]:
    tail = [line for line in output.splitlines() if line.strip()][-6:]
    return {"arch": arch, "outcome": "failing",
            "reason": "the launch died while running it: " + " | ".join(tail)[-600:]}


def prepared_root(out: Path) -> Path:
    """Where the prepared models and rows of the sweep writing ``out`` live."""
    return out.with_name(out.name + ".prepared")


def prepare_all(archs: list[str], root: Path, budget_s: float = float("inf")) -> None:
    """The single-process stage (`sweep_worker.prepare`) of every architecture of
    ``archs`` not prepared under ``root`` yet, until ``budget_s`` seconds have passed.
    A skipped architecture keeps only its row."""
    from tests.huggingface.sweep_worker import PREPARED, prepare

    start = time.monotonic()
    for arch in archs:
        directory = root / arch
        if (directory / PREPARED).exists():
            continue
        if time.monotonic() - start > budget_s:
            return
        shutil.rmtree(directory, ignore_errors=True)
        began = time.monotonic()
        row = prepare(arch, directory)
        row["prepare_seconds"] = round(time.monotonic() - began, 1)
        if row["outcome"] is not None:
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / PREPARED).write_text(json.dumps(row))
        print(f"prepared {arch}: {row['outcome'] or 'to train'} {row.get('reason', '')[:160]}", flush=True)


def train_all(archs: list[str], out: Path, budget_s: float = float("inf")) -> dict[str, dict[str, Any]]:
    """The 2-rank stage of the prepared architectures of ``archs`` that ``out`` has no
    row for, in as many torchrun launches as it takes (a launch that dies records the
    architecture it was running as failing, and the next starts after it), until
    ``budget_s`` seconds of launches have passed. Returns every row of ``out``."""
    from tests.distributed import torchrun
    from tests.huggingface.sweep_worker import PREPARED

    root = prepared_root(out)
    start = time.monotonic()
    while True:
        done = read_rows(out)
        for arch in done:  # finished: only its row is needed any more
            for item in (root / arch).glob("*"):
                if item.name != PREPARED:
                    shutil.rmtree(item) if item.is_dir() else item.unlink()
        todo = [a for a in archs if a not in done and (root / a / PREPARED).exists()]
        left = budget_s - (time.monotonic() - start)
        if not todo or left <= 0:
            return done
        try:
            proc = torchrun(WORKER, str(out), str(root), str(left), *todo,
                            timeout=min(LAUNCH_TIMEOUT_S, left + 900), check=False)
            output, failed = proc.stdout, proc.returncode != 0
        except TimeoutError as error:
            output, failed = str(error), True
        current = Path(f"{out}.current")
        if failed and current.exists():
            arch = current.read_text().strip()
            with out.open("a") as f:
                f.write(json.dumps(_died_row(arch, output)) + "\n")
            current.unlink()
        elif failed:
            raise RuntimeError(f"the sweep's launch failed before any architecture:\n{output[-4000:]}")


def run_sweep(archs: list[str], out: Path, budget_s: float = float("inf"),
              stages: tuple[str, ...] = ("prepare", "train")) -> dict[str, dict[str, Any]]:
    """Both stages (or those named) for ``archs``, rows into ``out``; every row of it."""
    start = time.monotonic()
    if "prepare" in stages:
        done = read_rows(out)
        prepare_all([a for a in archs if a not in done], prepared_root(out), budget_s)
    if "train" in stages:
        return train_all(archs, out, budget_s - (time.monotonic() - start))
    return read_rows(out)


def counts(rows: dict[str, dict[str, Any]]) -> str:
    """The count per outcome, with the transformers version: a markdown table."""
    import transformers

    by = collections.Counter(row["outcome"] for row in rows.values())
    lines = [f"transformers {transformers.__version__}, {len(rows)} causal-LM architectures",
             "", "| outcome | architectures |", "|---|---:|"]
    lines += [f"| {outcome} | {by.get(outcome, 0)} |" for outcome in OUTCOMES]
    return "\n".join(lines)


# Reason classes of the README's table: the first whose words the reason holds.
REASON_CLASSES = (
    ("MoE conversion (moe-load)", "MoE conversion (moe-load)"),
    ("converted checkpoint", "converted checkpoint:"),
    ("multimodal", "multimodal:"),
    ("transformers fails to build or save the tiny model", "transformers fails to build"),
    ("the sweep's generic tiny config does not build", "the tiny config does not build"),
    ("plain transformers fails a training step", "plain transformers fails a training step"),
    ("annot plan DIR --memory", "annot plan DIR --memory"),
    ("annot plan DIR", "annot plan DIR exited"),
    ("silent difference", "silent difference"),
    ("crash", "crash:"),
    ("the launch died", "the launch died"),
)


def reason_class(row: dict[str, Any]) -> str:
    """The class of a row's reason (`REASON_CLASSES`), or the reason itself."""
    reason = row.get("reason", "")
    return next((name for name, words in REASON_CLASSES if words in reason), reason[:80])


def by_reason(rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table: outcome, reason class, count and the architectures."""
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for arch, row in sorted(rows.items()):
        groups[(row["outcome"], reason_class(row) if row["outcome"] != "pass" else "")].append(arch)
    lines = ["| outcome | reason | count | architectures |", "|---|---|---:|---|"]
    for outcome in OUTCOMES:
        for (kind, reason), archs in sorted(groups.items()):
            if kind == outcome:
                lines.append(f"| {outcome} | {reason} | {len(archs)} | {', '.join(archs)} |")
    return "\n".join(lines)


def reasons(rows: dict[str, dict[str, Any]]) -> str:
    """Every row that did not pass, by outcome: ``arch: reason``."""
    lines = []
    for outcome in OUTCOMES[1:]:
        for arch, row in sorted(rows.items()):
            if row["outcome"] == outcome:
                lines.append(f"{outcome:8} {arch}: {row.get('reason', '')[:240]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.huggingface.sweep_causal_lm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="rows, one JSON object a line")
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds of launches in this call (the rest in a later one)")
    parser.add_argument("--rerun", action="store_true", help="run --only again even if --out has them")
    parser.add_argument("--stage", choices=("prepare", "train", "all"), default="all",
                        help="prepare: the single-process stage only (no launch); train: the "
                             "2-rank launches of what is prepared; all: both (default)")
    args = parser.parse_args(argv)
    archs = args.only.split(",") if args.only else causal_lm_types()
    if args.rerun and args.out.exists():
        kept = [line for line in args.out.read_text().splitlines()
                if line.strip() and json.loads(line)["arch"] not in archs]
        args.out.write_text("".join(f"{line}\n" for line in kept))
        for arch in archs:
            shutil.rmtree(prepared_root(args.out) / arch, ignore_errors=True)
    stages = ("prepare", "train") if args.stage == "all" else (args.stage,)
    rows = run_sweep(archs, args.out, args.budget, stages)
    print(reasons(rows))
    print()
    print(counts(rows))
    print()
    print(by_reason(rows))
    missing = [a for a in archs if a not in rows]
    if missing:
        print(f"\nnot run yet ({len(missing)}): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
