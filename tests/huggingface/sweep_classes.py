"""The class sweep (issue #42): the causal-LM sweep's check (tests/huggingface/sweep_causal_lm.py)
for every architecture of transformers' image-text-to-text, seq2seq, speech seq2seq,
multimodal-LM (the entries image-text lacks), masked-LM and image-classification
mappings, and for every diffusers transformer class. A tiny model each, loaded with
``annot.from_pretrained(DIR, "fsdp2")`` on 2 CPU ranks (plain, ``checkpoint=True``, and
for a model taking images or audio ``mixed``: rank 1 text only) and compared with the
library's own single-process ``from_pretrained`` stepped on each rank's batch, plus
``annot plan DIR`` and ``annot plan DIR --memory``. Each case (``CLASS/NAME``) ends as one
row: ``pass``, ``refused`` (an annot error, with its reason), ``skipped`` (with its
reason: the library itself fails to build, save, load or step the tiny model, or the
inputs builder refuses it) or ``failing`` (a crash, a hang or a launch that died, a
silent difference, a plan command that did not exit 0).

As a script (prints every reason, the count per class and outcome, and the outcomes by
reason class: the markdown tables of the guide)::

    python -m tests.huggingface.sweep_classes --out rows.jsonl [--classes image_text,seq2seq,...,diffusers]
        [--only a,b] [--budget S] [--stage prepare|train|all] [--rerun]

``--only`` takes model types (``t5``), diffusers class names (``FluxTransformer2DModel``)
or cases (``masked_lm/bart``). The stages (tests/huggingface/sweep_classes_worker.py) and
the row file behave as the causal-LM sweep's (tests/huggingface/sweep_driver.py): rows
already in ``--out`` are kept and not run again, so a long sweep runs in chunks. The
test (test_sweep_classes.py, ``-m sweep``) runs the same driver.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.huggingface import sweep_driver
from tests.huggingface.sweep_driver import Row, Rows

WORKER = Path(__file__).with_name("sweep_classes_worker.py")
KEY = "case"  # a row's name: CLASS/NAME (bart is both a seq2seq and a masked-LM case)
DIFFUSERS = "diffusers"
#: The sweep's classes, in the order they run: the class probe's, then diffusers'.
CLASSES = ("image_text", "seq2seq", "speech_seq2seq", "multimodal_lm", "causal_multimodal", "masked_lm",
           "image_classification", DIFFUSERS)


def class_cases(kinds: list[str]) -> list[str]:
    """Every case of the classes ``kinds``, class by class in `CLASSES`' order, each
    class's sorted."""
    unknown = [k for k in kinds if k not in CLASSES]
    if unknown:
        raise ValueError(f"unknown classes {unknown}; choose from {', '.join(CLASSES)}")
    cases: list[str] = []
    for kind in CLASSES:
        if kind not in kinds:
            continue
        if kind == DIFFUSERS:
            from tests.huggingface.diffusers_configs import transformer_classes

            names = list(transformer_classes())
        else:
            from tests.huggingface.probe_classes import architectures

            names = list(architectures(kind))
        cases += [f"{kind}/{name}" for name in names]
    return cases


def select(cases: list[str], only: list[str] | None) -> list[str]:
    """The cases ``only`` names (a case, or the name after its class: a model type or a
    diffusers class), in ``cases``' order; all of them without ``only``. Raises
    ValueError for a name no case has."""
    if not only:
        return cases
    wanted = set(only)
    chosen = [case for case in cases if case in wanted or case.partition("/")[2] in wanted]
    found = set(chosen) | {case.partition("/")[2] for case in chosen}
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(f"no case of the chosen classes is named {', '.join(missing)}")
    return chosen


def run_sweep(cases: list[str], out: Path, budget_s: float = float("inf"),
              stages: tuple[str, ...] = ("prepare", "train")) -> Rows:
    """Both stages (or those named) for ``cases``, rows into ``out``; every row of it."""
    from tests.huggingface.sweep_classes_worker import prepare

    return sweep_driver.run_stages(cases, out, prepare, WORKER, budget_s, stages, key=KEY)


def class_of(row: Row) -> str:
    """A row's class (the part of its case before the slash: a died row has no other)."""
    return row[KEY].partition("/")[0]


def counts(rows: Rows) -> str:
    """The library versions, then the count per class and outcome: a markdown table."""
    import diffusers
    import transformers

    head = f"transformers {transformers.__version__}, diffusers {diffusers.__version__}, {len(rows)} cases"
    return head + "\n\n" + sweep_driver.outcome_table(rows, class_of, "class")


# Reason classes of the guide's table: the first whose words the reason holds.
REASON_CLASSES = (
    *sweep_driver.CONVERSION_REASONS,
    ("the tiny config does not validate", "the tiny config does not validate"),
    ("transformers fails to build, save or load the tiny model", "transformers fails to build"),
    ("transformers: the forward computes no loss", "takes no labels"),
    ("transformers: the forward computes no loss", "returns no loss"),
    ("transformers fails a training step", "transformers fails a training step"),
    ("diffusers fails to build, save or load the tiny model", "diffusers fails to build"),
    ("diffusers fails a training step", "diffusers fails a training step"),
    ("the inputs builder refuses the model", "the inputs builder refuses it"),
    ("the inputs builder crashes", "the inputs builder"),
    ("the library's step fails on the builder's batch", "the reference step"),
    ("timed out preparing it", "timed out preparing it"),
    *sweep_driver.RUN_REASONS,
)


def by_reason(rows: Rows) -> str:
    """A markdown table: class, outcome, reason class, count and the architectures."""
    return sweep_driver.by_reason(rows, REASON_CLASSES, class_of, name=lambda case: case.partition("/")[2])


def main(argv: list[str] | None = None) -> int:
    parser = sweep_driver.sweep_parser("python -m tests.huggingface.sweep_classes", __doc__.split("\n\n")[0])
    parser.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {', '.join(CLASSES)}")
    args = parser.parse_args(argv)
    try:
        cases = select(class_cases(args.classes.split(",")), args.only.split(",") if args.only else None)
    except ValueError as error:
        parser.error(str(error))
    if args.rerun:
        sweep_driver.forget(args.out, cases, KEY)
    rows = run_sweep(cases, args.out, args.budget, sweep_driver.stages_of(args.stage))
    chosen = {case: rows[case] for case in cases if case in rows}
    sweep_driver.print_report(chosen, cases, [counts(chosen), by_reason(chosen)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
