"""The two stages of the causal-LM sweep (tests/huggingface/sweep_causal_lm.py).

`prepare` runs in one process, before any launch: rank 0's work and everything that
needs no process group. It builds the tiny config's model from a fixed seed and saves it
into PREPARED/ARCH, loads it with plain ``AutoModelForCausalLM.from_pretrained`` and takes
one training step on the whole batch (the reference: loss, every gradient, the trainable
names, saved beside the model), and runs ``annot plan DIR`` and ``annot plan DIR
--memory`` in that process. An architecture that cannot get this far is skipped there,
with the reason.

This file's main (`serve`, which the class sweep's worker shares) runs under torchrun on
2 CPU ranks, one launch for many architectures::

    python -m torch.distributed.run --nproc_per_node 2 sweep_worker.py ROWS PREPARED BUDGET_S ARCH...

For each prepared architecture in turn, until BUDGET_S seconds have passed:
``annot.from_pretrained(DIR, "fsdp2")`` and again with ``checkpoint=True``, one step on
this rank's half of the batch, the loss (mean over ranks) and every gradient (gathered
whole) compared with the reference. Rank 0 appends one JSON row per architecture to ROWS
as soon as it ends and writes the name of the one it starts into ROWS.current, so a
launch that dies leaves every finished row and says where it died (the driver records
that one as failing and goes on in a new launch). Ranks stay in step: each step ends
with both ranks exchanging their outcome, and the worst one decides; the process group's
timeout bounds a rank left waiting in a collective the other never joins.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.huggingface.sweep_configs import VOCAB, multimodal_reason, tiny_config

SEED = 0
SEQ = 16
ROWS_PER_RANK = 2
LOSS_RTOL = 1e-5  # relative, on the mean loss
GRAD_ATOL = 1e-4  # absolute, on every element of every gradient ...
# ... plus this much of the reference element: float32 sums in another order differ by a
# few millionths of their size, and a tiny model can have huge gradients (BLIP-2's
# zero-initialised query tokens, normalised: 1e10 and more, where 1e-4 is below one ulp).
GRAD_RTOL = 1e-5
COLLECTIVE_TIMEOUT_S = 600
WORLD_SIZE = 2
REFERENCE = "sweep-reference.pt"
PREPARED = "sweep-row.json"
# "transformers converts this tensor on load": annot.load's refusal of a checkpoint that
# transformers' weight converters fuse or split (annot/formats/transformers_keys.py). For MoE
# experts that is another change's work (moe-load); the sweep names it so.
CONVERSION_REFUSAL = "transformers converts this tensor on load"


def _first_line(error: BaseException) -> str:
    # Up to two lines: transformers' validation errors give the reason on the second.
    text = " ".join(line.strip() for line in str(error).strip().splitlines()[:2])
    return f"{type(error).__name__}: {text[:300]}"


def _where(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback, as ``file:line``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"


def batch(world: int) -> torch.Tensor:
    """The whole batch: ``ROWS_PER_RANK`` rows for each of ``world`` ranks."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (ROWS_PER_RANK * world, SEQ), generator=gen)


def _forward_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """``use_cache=False`` where the forward takes it: a training step, as annot runs one."""
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def _is_moe(config: Any) -> bool:
    keys = config.to_dict().keys()
    return any(k in keys for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                   "moe_num_experts", "num_routed_experts"))


def build_and_save(model_type: str, directory: Path) -> dict[str, Any]:
    """Rank 0: the tiny model saved into ``directory``; a skip row if it cannot be."""
    import transformers

    try:
        config = tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 - recorded as the row's reason
        return {"outcome": "skipped", "reason": f"the tiny config does not build: {_first_line(error)}"}
    reason = multimodal_reason(config)
    if reason:
        return {"outcome": "skipped", "reason": reason}
    try:
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(directory)
    except Exception as error:  # noqa: BLE001
        return {"outcome": "skipped",
                "reason": f"transformers fails to build or save it: {_first_line(error)} at {_where(error)}"}
    return {"outcome": None, "moe": _is_moe(config),
            "params": sum(p.numel() for p in model.parameters())}


def reference(directory: Path, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    """Plain transformers: from_pretrained, training mode, one step on the whole batch.
    Returns the loss, every gradient by name, and the trainable parameters' names."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    loss = model(input_ids=ids, labels=ids, **_forward_kwargs(model)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return loss.item(), grads, trainable


def annot_step(directory: Path, ids: torch.Tensor, **options: Any) -> tuple[float, dict[str, torch.Tensor | None], list[str]]:
    """annot.from_pretrained on this group, one step on this rank's rows: the mean loss
    over ranks, every gradient gathered whole (None where there is none), trainable names."""
    import annot

    model = annot.from_pretrained(directory, "fsdp2", device="cpu", **options)
    rank = dist.get_rank()
    rows = ids[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    return gathered_step(model, model(input_ids=rows, labels=rows).loss)


def gathered_step(model: torch.nn.Module, loss: torch.Tensor) -> tuple[float, dict[str, torch.Tensor | None], list[str]]:
    """``loss.backward()`` on every rank of the group, then what the sweeps compare: the
    mean loss over ranks, every gradient of ``model`` gathered whole (None where there
    is none), and the trainable parameters' names."""
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return mean.item() / dist.get_world_size(), grads, trainable


def compare(ref: tuple[float, dict[str, torch.Tensor], list[str]],
            got: tuple[float, dict[str, torch.Tensor | None], list[str]]) -> dict[str, Any]:
    """Figures and the first difference of annot's step against the reference's."""
    ref_loss, ref_grads, ref_trainable = ref
    loss, grads, trainable = got
    out: dict[str, Any] = {"loss": loss, "ref_loss": ref_loss,
                           "loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)}
    if set(trainable) != set(ref_trainable):
        out["difference"] = (f"trainable parameters differ: only annot {sorted(set(trainable) - set(ref_trainable))[:5]}, "
                             f"only the reference {sorted(set(ref_trainable) - set(trainable))[:5]}")
        return out
    worst, where, excess = 0.0, "", 0.0
    for name, ref_grad in ref_grads.items():
        grad = grads.get(name)
        if grad is None:
            out["difference"] = f"no gradient for {name} (the reference has one)"
            return out
        if grad.shape != ref_grad.shape:
            out["difference"] = f"gradient of {name}: shape {tuple(grad.shape)} vs {tuple(ref_grad.shape)}"
            return out
        if not grad.numel():
            continue
        diff = (grad.float() - ref_grad.float()).abs()
        beyond = (diff - GRAD_RTOL * ref_grad.float().abs()).max().item()
        if not beyond <= excess:  # NaN counts as worst
            worst, where, excess = diff.max().item(), name, beyond
    # grad_excess: the worst element's difference less GRAD_RTOL of its reference.
    out["grad_max"], out["grad_worst"], out["grad_excess"] = worst, where, excess
    if not out["loss_rel"] <= LOSS_RTOL:
        out["difference"] = f"loss {loss!r} vs {ref_loss!r} (relative {out['loss_rel']:.2e} > {LOSS_RTOL})"
    elif not excess <= GRAD_ATOL:
        out["difference"] = (f"gradient of {where} off by {worst:.2e} > {GRAD_ATOL} + {GRAD_RTOL} x the "
                             "reference's element")
    return out


#: The sequence length ``annot plan DIR --memory`` traces in the sweep.
PLAN_SEQ = 256


def plan_command(directory: Path, *extra: str) -> dict[str, Any]:
    """``annot plan DIR [extra]`` in this process: exit status and the stderr tail."""
    from annot.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", str(directory), *extra])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except Exception:  # noqa: BLE001 - a crash of the command: its traceback is the reason
            code = -1
            traceback.print_exc(file=err)
    return {"rc": code, "stderr": err.getvalue()[-1500:], "stdout_lines": len(out.getvalue().splitlines())}


def _refusal(error: BaseException, moe: bool) -> str:
    reason = _first_line(error)
    if CONVERSION_REFUSAL in str(error):
        # the tensor it names: an expert's (moe-load's work) or another fused one
        expert = moe and ".experts." in str(error).split(":")[0]
        kind = "MoE conversion (moe-load)" if expert else "converted checkpoint"
        return f"{kind}: {reason}"
    return reason


def _agree(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def prepare(model_type: str, directory: Path) -> dict[str, Any]:
    """The single-process part of one architecture, run before the launch (no process
    group): the tiny model saved into ``directory``, the reference step (its loss,
    gradients and trainable names in ``directory/REFERENCE``), ``annot plan DIR`` and
    ``annot plan DIR --memory``. Returns the row so far; its ``outcome`` is ``skipped``
    (with the reason) or None (the launch decides)."""
    row: dict[str, Any] = {"arch": model_type, **build_and_save(model_type, directory)}
    if row["outcome"] is not None:
        return row
    try:
        ref = reference(directory, batch(WORLD_SIZE))
        if not torch.isfinite(torch.tensor(ref[0])):
            raise FloatingPointError(f"a non-finite loss {ref[0]}")
    except Exception as exc:  # noqa: BLE001
        return {**row, "outcome": "skipped",
                "reason": f"plain transformers fails a training step: {_first_line(exc)} at {_where(exc)}"}
    torch.save(ref, directory / REFERENCE)
    row["plan"] = plan_command(directory)
    # At 256 tokens: what is checked is that the command plans every architecture; at
    # 2048, Mamba's, Falcon-Mamba's and RWKV's slow paths, a loop over tokens, traced
    # for more than 15 minutes each.
    row["plan_memory"] = plan_command(directory, "--memory", "--seq", str(PLAN_SEQ))
    return row


def run_scenario(run: Callable[[], dict[str, Any]], moe: bool = False) -> dict[str, Any]:
    """``run()`` on every rank (one scenario of one architecture: annot's step compared
    with its reference); its result, the annot error that refused it (``refused``, with
    ``moe`` naming an experts' conversion as `_refusal` does) or the crash. The ranks
    agree: where one rank crashed, was refused or saw a difference, that is the answer."""
    from annot.policies.errors import AnnotError

    try:
        result = run()
    except AnnotError as exc:
        result = {"refused": _refusal(exc, moe), "error_type": type(exc).__name__}
    except Exception as exc:  # noqa: BLE001
        result = {"crash": f"{_first_line(exc)} at {_where(exc)}",
                  "traceback": traceback.format_exc()[-3000:]}
    return next((r for r in _agree(result) if set(r) & {"crash", "refused", "difference"}), result)


def run_arch(prepared: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The 2-rank part of one prepared architecture, on every rank: annot's two steps
    compared with the reference; the final row."""
    row = dict(prepared)
    ref = torch.load(directory / REFERENCE)
    ids = batch(dist.get_world_size())
    for label, options in SCENARIOS.items():
        row[label] = run_scenario(lambda options=options: compare(ref, annot_step(directory, ids, **options)),
                                  row.get("moe", False))
    row["outcome"], row["reason"] = classify(row)
    return row


#: Scenario label (the row's field) -> from_pretrained's options.
SCENARIOS: dict[str, dict[str, Any]] = {"fsdp2": {}, "fsdp2_checkpoint": {"checkpoint": True}}


def classify(row: dict[str, Any], labels: Iterable[str] = tuple(SCENARIOS)) -> tuple[str, str]:
    """pass, refused (an annot error, with its reason) or failing (a crash, a silent
    difference, or a plan command that did not exit 0 on a model that trains), from the
    row's scenarios ``labels`` (each a `run_scenario` result) and its plan commands."""
    from annot.cli.main import CANNOT_TRACE_VALUES

    runs = [row[label] for label in labels]
    for run in runs:
        if "crash" in run:
            return "failing", f"crash: {run['crash']}"
        if "difference" in run:
            return "failing", f"silent difference: {run['difference']}"
    refused = [run for run in runs if "refused" in run]
    if refused:
        return "refused", refused[0]["refused"]
    for key, command in (("plan", "annot plan DIR"), ("plan_memory", "annot plan DIR --memory")):
        if row[key]["rc"] == 2 and CANNOT_TRACE_VALUES in row[key]["stderr"]:
            # the planner's refusal by name: the forward reads values a trace of shapes lacks
            return "refused", f"{command}: {row[key]['stderr'].strip().splitlines()[-1][:300]}"
        if row[key]["rc"] != 0:
            last = (row[key]["stderr"].strip().splitlines() or [""])[-1]
            return "failing", f"{command} exited {row[key]['rc']}: {last[:300]}"
    return "pass", ""


def serve(run_one: Callable[[dict[str, Any], Path], dict[str, Any]]) -> None:
    """A sweep worker's main, under torchrun: ``ROWS PREPARED BUDGET_S NAME...`` from
    the command line; for each name in turn, until BUDGET_S seconds have passed, its
    prepared row (PREPARED/NAME/`PREPARED`) as it is where it already has an outcome,
    else ``run_one(prepared row, PREPARED/NAME)`` on every rank. Rank 0 writes the name
    it starts into ROWS.current and appends each final row to ROWS."""
    rows_path, prepared_root, budget, *names = sys.argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    start = time.monotonic()
    rows_file = Path(rows_path)
    for name in names:
        if time.monotonic() - start > float(budget):
            break
        directory = Path(prepared_root) / name
        prepared = json.loads((directory / PREPARED).read_text())
        if rank == 0:
            Path(f"{rows_path}.current").write_text(name)
        began = time.monotonic()
        row = prepared if prepared["outcome"] is not None else run_one(prepared, directory)
        row["seconds"] = round(time.monotonic() - began, 1)
        if rank == 0:
            with rows_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"sweep: {name}: {row['outcome']} {row.get('reason', '')[:160]}", flush=True)
        dist.barrier()
    if rank == 0:
        Path(f"{rows_path}.current").unlink(missing_ok=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown (tests/distributed.py, worker_main)


if __name__ == "__main__":
    serve(run_arch)
