"""``annot plan MODEL --memory --budget SIZE``: `annot.memory.budget.fit_budget` from the
command line. Prints the answer (``--json``: the fields of `BudgetAnswer.to_dict`),
draws it with ``--plot FILE``; exit 3 when nothing fits, with one line naming the
smallest budget that would."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["cp_sizes", "run_budget"]


def cp_sizes(text: str) -> tuple[int, ...]:
    """``--cp 2,4,8`` as sizes (a `ValueError` naming the option for anything else)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--cp {text!r}: give sizes as integers, comma-separated (e.g. 2,4,8)") from None


def run_budget(args: argparse.Namespace, model: Any, plan: Any, budget: int | None,
               reserve: int | None) -> int:
    """Solve ``budget`` (bytes, ``args.budget`` read) for ``model`` under ``plan``; the
    exit status."""
    from annot.memory import MARGIN, RESERVE
    from annot.memory.budget import BudgetError, budget_solver
    from annot.memory.inputs import model_inputs
    from annot.policies import AnnotError

    try:
        if budget is None:
            raise ValueError("--plot draws a budget answer: give --budget SIZE too")
        solver = budget_solver(
            model, plan=plan, gpus=args.gpus, nodes=args.nodes, batch=args.batch, seq=args.seq,
            precision=args.precision, optimizer=args.optimizer, device=args.device,
            tflops=args.tflops, hbm_bw=args.hbm_bw, host_bw=args.host_bw,
            margin=MARGIN if args.margin is None else args.margin,
            reserve=RESERVE if reserve is None else reserve, cp=cp_sizes(args.cp),
            cp_attention=args.cp_attention, inputs=model_inputs(media_sizes(args)),
            quantize=args.quantize, unquantized=args.unquantized)
        answer = solver.fit(budget)
        if args.plot is not None:
            from annot.memory.plot import plot_budget

            plot_budget(answer, args.plot)
    except BudgetError as exc:
        print(f"annot plan: {exc}", file=sys.stderr)
        return 3
    except (AnnotError, ValueError) as exc:
        print(f"annot plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer.to_dict(), indent=2))
    else:
        print(answer.table())
        if args.plot is not None:
            print(f"picture: {args.plot}")
    return 0


def media_sizes(args: argparse.Namespace) -> Any:
    """`annot.memory.inputs.MediaSizes` from the command line's size options."""
    from annot.memory.inputs import MediaSizes

    return MediaSizes(image_size=args.image_size, images=args.images, audio_frames=args.audio_frames,
                      latent_size=args.latent_size, frames=args.frames, text_tokens=args.text_tokens)
