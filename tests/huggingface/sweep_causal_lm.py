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
(test_sweep_causal_lm.py, ``-m sweep``) runs the same driver. What it shares with the
class sweep (rows, launches, tables) is tests/huggingface/sweep_driver.py.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

from tests.huggingface import sweep_driver
from tests.huggingface.sweep_driver import OUTCOMES, Rows, forget, prepared_root, read_rows  # noqa: F401 - re-exported

WORKER = Path(__file__).with_name("sweep_worker.py")


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM head, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_sweep(archs: list[str], out: Path, budget_s: float = float("inf"),
              stages: tuple[str, ...] = ("prepare", "train")) -> Rows:
    """Both stages (or those named) for ``archs``, rows into ``out``; every row of it."""
    from tests.huggingface.sweep_worker import prepare

    return sweep_driver.run_stages(archs, out, prepare, WORKER, budget_s, stages)


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
    *sweep_driver.CONVERSION_REASONS,
    ("multimodal", "multimodal:"),
    ("transformers fails to build or save the tiny model", "transformers fails to build"),
    ("the sweep's generic tiny config does not build", "the tiny config does not build"),
    ("plain transformers fails a training step", "plain transformers fails a training step"),
    *sweep_driver.RUN_REASONS,
)


def reason_class(row: dict[str, Any]) -> str:
    """The class of a row's reason (`REASON_CLASSES`), or the reason itself."""
    return sweep_driver.reason_class(row, REASON_CLASSES)


def by_reason(rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table: outcome, reason class, count and the architectures."""
    return sweep_driver.by_reason(rows, REASON_CLASSES)


def main(argv: list[str] | None = None) -> int:
    parser = sweep_driver.sweep_parser("python -m tests.huggingface.sweep_causal_lm", __doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    archs = args.only.split(",") if args.only else causal_lm_types()
    if args.rerun:
        forget(args.out, archs)
    rows = run_sweep(archs, args.out, args.budget, sweep_driver.stages_of(args.stage))
    sweep_driver.print_report(rows, archs, [counts(rows), by_reason(rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
