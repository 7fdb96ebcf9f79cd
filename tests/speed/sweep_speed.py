"""Float8 and compiled blocks on every causal-LM architecture of the installed transformers.

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the tiny config of the causal-LM
sweep, `tests.huggingface.sweep_configs.tiny_config`), in one process:

1. the Plan with ``float8="tensorwise", compile=True`` (its repeated blocks);
2. float8: the eligible linears swapped (`annot.float8.apply_float8`); the state-dict
   keys must be the bare model's, and a training step's loss finite;
3. compile: the eager model and a copy with its blocks checkpointed and compiled
   (`annot.compiled_blocks`, backend ``aot_eager``); one forward and backward each. The
   loss and every gradient must agree within 1e-5, whatever the blocks compiled as
   (whole, with graph breaks, or eager after a fallback: each is recorded with its reason).

Each architecture ends as one row: ``pass`` (with how many linears became float8, and the
blocks' compile statuses and graph breaks), ``skipped`` (multimodal, or transformers'
own forward fails on the tiny model), ``refused`` (annot says why: no repeated block) or
``failing`` (a crash or a difference). As a script::

    python -m tests.speed.sweep_speed [--only llama,qwen2] [--out rows.jsonl]

prints a markdown table of the counts and the compile statuses. The test
(test_speed_sweep.py, ``-m sweep``) runs it on every architecture.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import traceback
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 1e-5
SEQ = 16


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _build(model_type: str) -> Any:
    import transformers

    from tests.huggingface.sweep_configs import multimodal_reason, tiny_config

    try:
        config = tiny_config(model_type)
    except Exception as exc:  # noqa: BLE001 (transformers refuses its own tiny config: a skip)
        raise _Skip(f"transformers cannot configure it: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    reason = multimodal_reason(config)
    if reason is not None:
        raise _Skip(reason)
    torch.manual_seed(0)
    try:
        return transformers.AutoModelForCausalLM.from_config(config).train()
    except Exception as exc:  # noqa: BLE001 (transformers' own failure: a skip, with it)
        raise _Skip(f"transformers cannot build it: {type(exc).__name__}: {exc}") from None


class _Skip(Exception):
    pass


def _loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens, labels=tokens, use_cache=False)
    return out.loss


def row(model_type: str) -> dict[str, Any]:
    """One architecture's row (module docstring)."""
    import annot
    from annot.compiled_blocks import CompileOptions, compile_report, compile_units
    from annot.float8 import apply_float8
    from annot.huggingface.model import prepare_for_training
    from annot.policies import Action, PlanError
    from annot.runtime.activation_checkpoint import apply_checkpointing

    try:
        model = _build(model_type)
        vocab = model.get_input_embeddings().num_embeddings
        tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
        try:
            eager_loss = _loss(model, tokens)
        except Exception as exc:  # noqa: BLE001
            raise _Skip(f"transformers' forward fails: {type(exc).__name__}: {exc}") from None
        eager_loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        try:
            plan = annot.plan(model, float8="tensorwise", compile=True)
        except PlanError as exc:
            return {"arch": model_type, "outcome": "refused", "reason": str(exc).splitlines()[0]}
        model.zero_grad(set_to_none=True)

        compiled = _build(model_type)  # the same seed: the same weights (a copy fails on weight_norm)
        prepare_for_training(compiled, checkpointing=True)
        apply_checkpointing(compiled, plan.paths(Action.CHECKPOINT) or plan.paths(Action.COMPILE))
        torch._dynamo.reset()
        compile_units(compiled, plan.paths(Action.COMPILE), CompileOptions(backend="aot_eager"))
        loss = _loss(compiled, tokens)
        loss.backward()
        differences = [n for n, g in grads.items()
                       if not torch.allclose(dict(compiled.named_parameters())[n].grad, g, rtol=0,
                                             atol=TOLERANCE)]
        report = compile_report(compiled)
        if abs(loss.item() - eager_loss.item()) > TOLERANCE or differences:
            return {"arch": model_type, "outcome": "failing",
                    "reason": f"compiled differs from eager: loss {loss.item()} vs {eager_loss.item()}, "
                              f"gradients {differences[:3]}"}

        keys = list(model.state_dict())
        converted = apply_float8(model, plan, log=False)
        if list(model.state_dict()) != keys:
            return {"arch": model_type, "outcome": "failing", "reason": "float8 changed the state-dict keys"}
        float8_loss = _loss(model, tokens)
        float8_loss.backward()
        if not math.isfinite(float8_loss.item()):
            return {"arch": model_type, "outcome": "failing", "reason": f"float8 loss {float8_loss.item()}"}
        return {"arch": model_type, "outcome": "pass", "float8_linears": len(converted.paths),
                "kept": len(converted.kept),
                "compile": sorted(collections.Counter(c.status for c in report).items()),
                "graph_breaks": sum(c.graph_breaks for c in report),
                "reasons": sorted({c.reason for c in report if c.reason})[:2]}
    except _Skip as skip:
        return {"arch": model_type, "outcome": "skipped", "reason": str(skip)[:300]}
    except Exception as exc:  # noqa: BLE001 (a row, not a crash of the sweep)
        return {"arch": model_type, "outcome": "failing",
                "reason": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}


def table(rows: list[dict[str, Any]]) -> str:
    import transformers

    by = collections.Counter(r["outcome"] for r in rows)
    statuses: collections.Counter[str] = collections.Counter()
    for r in rows:
        for status, n in r.get("compile", ()):
            statuses[status] += n
    lines = [f"transformers {transformers.__version__}, {len(rows)} causal-LM architectures", "",
             "| outcome | architectures |", "|---|---:|"]
    lines += [f"| {o} | {by.get(o, 0)} |" for o in ("pass", "refused", "skipped", "failing")]
    lines += ["", "compiled blocks: " + ", ".join(f"{n} {s}" for s, n in statuses.most_common())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--out", type=Path, help="write the rows as JSON lines")
    args = parser.parse_args(argv)
    logging.getLogger("annot").setLevel(logging.ERROR)  # each fallback is in its row
    archs = args.only.split(",") if args.only else causal_lm_types()
    rows = []
    for arch in archs:
        rows.append(row(arch))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(table(rows))
    for r in rows:
        if r["outcome"] in ("failing", "refused"):
            print(f"{r['arch']}: {r['outcome']}: {r['reason']}")
    return rows


if __name__ == "__main__":
    main()
