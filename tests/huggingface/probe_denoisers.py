"""Probe every transformer (denoiser) class of the installed diffusers with a tiny config:
build, save and load back, two flow-matching training steps from one seed (bitwise equal
losses), which trainable parameters got no gradient, one bfloat16 step, and the hints
annot's sharding reads (`_no_split_modules` and its kin, repeated blocks it misses, bare
parameters). One JSON row per class; a summary at the end.

    python -m tests.huggingface.probe_denoisers --out rows.jsonl [--only ClassA,ClassB]

Each class ends ``ok``, ``skipped`` (a failure inside diffusers itself, listed in
`DIFFUSERS_FAILURES` with where it fails; the row keeps the error), ``no_inputs`` (the
builder refuses the class, with its reason) or ``failed`` (anything else: a bug of the
builder or the config, to fix).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
from torch import nn

from annot.huggingface.denoiser_inputs import denoiser_inputs, flow_matching_loss
from tests.huggingface.diffusers_configs import tiny_denoiser_config, transformer_classes

BATCH = 2
SEED = 0
# Classes whose training step fails inside diffusers on any input, with where it fails.
DIFFUSERS_FAILURES: dict[str, str] = {}
# Attention diffusers runs through torch's FlexAttention (a BlockMask) unconditionally,
# whose backward torch implements on GPUs only: on a CPU the probe checks the forward.
FLEX_ONLY = {
    "AnyFlowFARTransformer3DModel": "its chunked causal attention is a flex BlockMask "
                                    "(transformer_anyflow_far.py, _build_far_block_mask_from_far_cfg)",
    "Kandinsky6SRTransformer3DModel": "its NABLA sparse attention runs on flex attention (transformer_kandinsky6_sr.py)",
}
# Classes that take one sample per forward (a packed sequence without a batch axis).
ONE_SAMPLE = {"Cosmos3OmniTransformer"}


def batch_size(model: nn.Module) -> int:
    """The samples of one training step of ``model`` (`ONE_SAMPLE`: one)."""
    return 1 if type(model).__name__ in ONE_SAMPLE else BATCH


def flex_backward_reason(name: str, error: BaseException) -> str | None:
    """Why class ``name`` takes no training step here where ``error`` is torch's
    FlexAttention lacking a backward on CPU and the class is one of `FLEX_ONLY`; None
    for any other error."""
    if name in FLEX_ONLY and isinstance(error, NotImplementedError) and \
            "FlexAttention does not support backward" in str(error):
        return (f"torch's FlexAttention has no backward on CPU and {FLEX_ONLY[name]}; "
                f"run on a GPU for the training step")
    return None


def _step(model: nn.Module, seed: int) -> tuple[float, torch.Tensor]:
    """One training step from ``seed``: inputs, forward, loss, backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # classes that draw inside their forward draw the same
    generator = torch.Generator().manual_seed(seed)
    inputs, target = denoiser_inputs(model, batch=batch_size(model), generator=generator)
    loss = flow_matching_loss(model, inputs, target)
    loss.backward()
    return loss.item(), loss.detach()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: a parameter a class leaves uninitialized (``torch.empty``) is
    NaN under deterministic algorithms, and NaN equals nothing."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8) if a.is_floating_point() else a,
                       b.contiguous().view(torch.uint8) if b.is_floating_point() else b)


def _forward_only(model: nn.Module) -> str:
    """The forward and loss without gradients: the inputs are right even where the
    backward cannot run here."""
    try:
        with torch.no_grad():
            inputs, target = denoiser_inputs(model, batch=batch_size(model), generator=torch.Generator().manual_seed(SEED))
            loss = flow_matching_loss(model, inputs, target)
        return f"ok, loss {loss.item():.4f}"
    except Exception as error:
        return _short(error)


def _repeated_lists(model: nn.Module) -> list[tuple[str, str]]:
    """(path, class) of every nn.ModuleList of at least two blocks of one class (a block
    holds submodules: a list of norms or linears is not one)."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and any(True for _ in module[0].children()):
            kinds = {type(m).__name__ for m in module}
            if len(kinds) == 1:
                found.append((path, kinds.pop()))
    return found


def _hints(model: nn.Module) -> dict[str, Any]:
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    repeated = _repeated_lists(model)
    block_classes = sorted({kind for _, kind in repeated})
    bare_top = sorted(model._parameters)
    bare_blocks = sorted({f"{kind}.{name}" for path, kind in repeated
                          for block in model.get_submodule(path) for name in block._parameters})
    return {
        "no_split_modules": getattr(model, "_no_split_modules", None),
        "repeated_blocks": getattr(model, "_repeated_blocks", None),
        "keep_in_fp32_modules": getattr(model, "_keep_in_fp32_modules", None),
        "skip_layerwise_casting_patterns": getattr(model, "_skip_layerwise_casting_patterns", None),
        "block_lists": [f"{path} ({kind})" for path, kind in repeated],
        "blocks_not_in_no_split": [k for k in block_classes if k not in no_split],
        "bare_params_top": bare_top,
        "bare_params_blocks": bare_blocks,
    }


def _short(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames)
                  if "site-packages/diffusers" in f.filename or "site-packages/torch" not in f.filename), "?")
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''} [at {where}]"


def _fake_step(model: nn.Module) -> str:
    """Inputs and one forward and loss for a copy of ``model`` holding fake parameters,
    under the FakeTensorMode annot's memory planner uses."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    from annot.memory.activations import fake_copy

    fake, mode = fake_copy(model, None)
    with mode:
        inputs, target = denoiser_inputs(fake, batch=batch_size(model), generator=torch.Generator().manual_seed(SEED))
        real = [t for t in tree_leaves((inputs, target)) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]
        if real:
            return f"inputs hold {len(real)} real tensors"
        try:
            flow_matching_loss(fake, inputs, target).backward()
        except Exception as error:  # the forward itself reads values: diffusers' own
            return f"inputs ok; forward: {_short(error)}"
    return "ok"


def probe(name: str, cls: type) -> dict[str, Any]:
    row: dict[str, Any] = {"class": name}
    start = time.monotonic()
    try:
        config = tiny_denoiser_config(name)
        torch.manual_seed(SEED)
        built = cls.from_config(config)
        with tempfile.TemporaryDirectory() as folder:
            built.save_pretrained(folder)
            model = cls.from_pretrained(folder)
            before, after = built.state_dict(), model.state_dict()
            same = before.keys() == after.keys() and all(_same_bits(before[k], after[k]) for k in before)
            row["roundtrip"] = "ok" if same else "weights differ after save/load"
            row["params"] = sum(p.numel() for p in model.parameters())
            row.update(_hints(model))
            model.train()
            try:  # the builder alone: a refusal is the builder's answer, not a failure
                denoiser_inputs(model, batch=batch_size(model), generator=torch.Generator().manual_seed(SEED))
            except ValueError as error:
                row.update(status="no_inputs", reason=str(error))
                return row
            # Before any real forward: some modules cache real tensors on their first one.
            row["fake"] = _fake_step(model)
            try:
                loss_a, _ = _step(model, SEED)
            except NotImplementedError as error:
                reason = flex_backward_reason(name, error)
                if reason is None:
                    raise
                row.update(status="skipped", error=_short(error), forward=_forward_only(model), reason=reason)
                return row
            unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            loss_b, _ = _step(model, SEED)
            row["loss"] = loss_a
            row["deterministic"] = loss_a == loss_b
            row["finite"] = math.isfinite(loss_a)
            row["no_grad_params"] = unused
            try:
                half = cls.from_pretrained(folder, torch_dtype=torch.bfloat16)
                half.train()
                loss_h, _ = _step(half, SEED)
                row["bf16"] = "ok" if math.isfinite(loss_h) else f"loss {loss_h}"
            except Exception as error:
                row["bf16"] = _short(error)
        ok = row["deterministic"] and row["finite"] and row["roundtrip"] == "ok"
        row["status"] = "ok" if ok else "failed"
        if name in DIFFUSERS_FAILURES:
            row["note"] = "listed in DIFFUSERS_FAILURES but passed"
    except Exception as error:
        row["error"] = _short(error)
        if name in DIFFUSERS_FAILURES:
            row.update(status="skipped", reason=DIFFUSERS_FAILURES[name])
        else:
            row["status"] = "failed"
            row["traceback"] = traceback.format_exc()[-3000:]
    finally:
        row["seconds"] = round(time.monotonic() - start, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines, one row per class")
    parser.add_argument("--only", help="comma-separated class names")
    args = parser.parse_args(argv)
    classes = transformer_classes()
    if args.only:
        wanted = args.only.split(",")
        missing = [n for n in wanted if n not in classes]
        if missing:
            parser.error(f"not diffusers transformer classes: {', '.join(missing)}")
        classes = {n: classes[n] for n in wanted}
    torch.use_deterministic_algorithms(True, warn_only=True)
    counts: dict[str, int] = {}
    with open(args.out, "w") as out:
        for name, cls in classes.items():
            with contextlib.redirect_stdout(sys.stderr):
                row = probe(name, cls)
            out.write(json.dumps(row) + "\n")
            out.flush()
            counts[row["status"]] = counts.get(row["status"], 0) + 1
            detail = row.get("reason") or row.get("error") or (
                f"loss {row['loss']:.4f} bf16 {row['bf16'][:60]} unused {len(row['no_grad_params'])}")
            print(f"{row['status']:9} {name:42} {row['seconds']:5}s {detail}", flush=True)
    print("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if not counts.get("failed") else 1


if __name__ == "__main__":
    raise SystemExit(main())
