"""The class probe: every architecture of transformers' non-causal-LM auto mappings
(image-text-to-text, seq2seq, speech seq2seq, the multimodal LMs beyond image-text,
masked LM, image classification) trained for one step on plain transformers, with the
tiny config of tests/huggingface/sweep_configs.py and the batch of
`annot.huggingface.example_inputs.training_inputs`.

For each architecture, in this one process: the tiny config, the mapping's class built
from it (fixed seed), saved and loaded back with ``save_pretrained`` /
``from_pretrained``, then one training step (training mode, forward, ``loss.backward()``)
twice on the same batch, whose losses must be bitwise equal (a dropout or other noise
left on would differ), and for a model that takes images one more step on a text-only
batch (``with_images=False``). Each architecture ends as one JSON row:

- ``ok``;
- ``skipped``: transformers itself fails (the tiny config does not validate, the model
  does not build, save or load, or its training step fails on a batch it was given
  right; the last only for the architectures of `TRANSFORMERS_FAILURES`, each with the
  words its error must hold, so a new failure is never waved through);
- ``no_inputs``: `training_inputs` refused the model (its ``ValueError``);
- ``failing``: anything else (a crash, a non-finite loss, losses that differ).

As a script (prints the count per outcome and class)::

    python -m tests.huggingface.probe_classes --out rows.jsonl [--only a,b] [--classes image_text,seq2seq]
        [--budget SECONDS] [--rerun]

Rows already in ``--out`` are kept and their architectures not run again, so a long
probe runs in chunks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import math
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SEED = 0
BATCH = 2
SEQ = 64
ARCH_TIMEOUT_S = 240
OUTCOMES = ("ok", "skipped", "no_inputs", "failing")
#: Probe class -> (the auto mapping's name, the Auto class), in the order they run.
CLASSES = {
    "image_text": ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "speech_seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "multimodal_lm": ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "AutoModelForMultimodalLM"),
    "masked_lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "image_classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    # The causal LMs whose configs hold a vision or audio part: the causal-LM sweep skips
    # them (its recipe shrinks text configs), this one trains them with their media.
    "causal_multimodal": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
}
#: Architectures whose training step fails inside transformers on a batch of the shape
#: the model asks for: (class, architecture) -> (words the error must hold, the reason).
TRANSFORMERS_FAILURES: dict[tuple[str, str], tuple[str, str]] = {
    ("image_text", "llama4"): (
        "has no attribute 'image_outputs'",
        "Llama4ForConditionalGeneration.forward reads image_outputs from its language model's "
        "output (a MoeCausalLMOutputWithPast, which has none), with or without images"),
}


def architectures(kind: str) -> dict[str, str]:
    """Model type -> class name of one probe class (the first class where the mapping
    lists several). ``multimodal_lm`` holds only the entries image-text-to-text lacks."""
    from transformers.models.auto import modeling_auto

    mapping = dict(getattr(modeling_auto, CLASSES[kind][0]))
    if kind == "multimodal_lm":
        image_text = getattr(modeling_auto, CLASSES["image_text"][0])
        mapping = {k: v for k, v in mapping.items() if k not in image_text}
    if kind == "causal_multimodal":
        mapping = {k: v for k, v in mapping.items() if _multimodal_causal(k)}
    return {k: (v[0] if isinstance(v, tuple) else v) for k, v in sorted(mapping.items())}


def _multimodal_causal(model_type: str) -> bool:
    """Whether the causal-LM sweep skips ``model_type`` as multimodal (its tiny config
    holds a vision or audio part)."""
    from tests.huggingface.sweep_configs import multimodal_reason, tiny_config

    try:
        return multimodal_reason(tiny_config(model_type)) is not None
    except Exception:  # noqa: BLE001 - a config the causal sweep cannot build: not this class's
        return False


def _first_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).strip().splitlines()[:2])
    return f"{type(error).__name__}: {text[:300]}"


def _where(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback as ``file:line``."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in this (main) thread after ``seconds``: one hanging
    architecture ends as a row instead of ending the chunk."""
    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {seconds} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class NoLoss(Exception):
    """The forward was given labels and returned no loss."""


def _step(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[float, float]:
    """One training step: the loss and the sum of every gradient's absolute values."""
    model.zero_grad(set_to_none=True)
    loss = getattr(model(**inputs), "loss", None)
    if loss is None:
        raise NoLoss(f"{type(model).__name__}.forward returns no loss although labels were given")
    loss.backward()
    grads = sum(p.grad.double().abs().sum().item() for p in model.parameters() if p.grad is not None)
    return loss.item(), grads


def takes_media(inputs: dict[str, Any]) -> bool:
    from annot.huggingface.example_inputs import AUDIO_INPUTS, IMAGE_INPUTS

    return any(key in IMAGE_INPUTS | AUDIO_INPUTS | {"flattened_patches"} for key in inputs)


class Skipped(Exception):
    """transformers itself cannot give the tiny model a training step: the message is
    the reason (the tiny config does not validate; the model does not build, save or
    load; its forward takes no labels)."""


def tiny_model(kind: str, arch: str, class_name: str, directory: Path) -> torch.nn.Module:
    """The tiny model of ``arch`` for probe class ``kind``: ``class_name`` built from
    the tiny config and `SEED`, saved into ``directory`` with ``save_pretrained`` and
    loaded back with ``from_pretrained``, in training mode. Raises `Skipped`."""
    import transformers

    from tests.huggingface.sweep_configs import tiny_config

    try:
        config = tiny_config(arch, kind)
    except Exception as error:  # noqa: BLE001 - the reason
        raise Skipped(f"the tiny config does not validate: {_first_line(error)}") from error
    try:
        cls = getattr(transformers, class_name)
        torch.manual_seed(SEED)
        if kind == "causal_multimodal":
            # The causal-LM class of a composite config takes its text part: the auto
            # class picks it (as from_pretrained of such a checkpoint does).
            built = getattr(transformers, CLASSES[kind][1]).from_config(config)
            cls = type(built)
        else:
            built = cls._from_config(config)
        built.save_pretrained(directory)
        del built
        model = cls.from_pretrained(directory).train()
    except Exception as error:  # noqa: BLE001
        raise Skipped(f"transformers fails to build, save or load it: {_first_line(error)} at {_where(error)}") \
            from error
    if "labels" not in inspect.signature(model.forward).parameters:
        raise Skipped(f"transformers: {class_name}.forward takes no labels (it computes no loss)")
    return model


def probe(kind: str, arch: str, class_name: str) -> dict[str, Any]:
    """One architecture's row (see the module's text)."""
    from annot.huggingface.example_inputs import ExampleInputsError, training_inputs

    row: dict[str, Any] = {"class": kind, "arch": arch, "model_class": class_name}
    with tempfile.TemporaryDirectory() as directory:
        try:
            model = tiny_model(kind, arch, class_name, Path(directory))
        except Skipped as error:
            return {**row, "outcome": "skipped", "reason": str(error)}
        row["params"] = sum(p.numel() for p in model.parameters())
        try:
            seq = seq_for(model, training_inputs)
            row["seq"] = seq
            inputs = training_inputs(model, batch=BATCH, seq=seq, generator=torch.Generator().manual_seed(1))
        except ExampleInputsError as error:
            return {**row, "outcome": "no_inputs", "reason": _first_line(error)}
        except Exception as error:  # noqa: BLE001
            return failure_row(row, kind, arch, "inputs", error)
        row["inputs"] = {k: list(v.shape) if isinstance(v, torch.Tensor) else repr(v)[:40]
                         for k, v in inputs.items()}
        fake = _fake_difference(model, inputs, seq)
        if fake:
            return {**row, "outcome": "failing", "reason": f"with fake parameters: {fake}"}
        stage = "step"
        try:
            torch.manual_seed(SEED)
            first = _step(model, inputs)
            stage = "second step"
            second = _step(model, inputs)
            row["loss"] = first[0]
            if not (math.isfinite(first[0]) and math.isfinite(first[1])):
                return {**row, "outcome": "failing", "reason": f"a non-finite loss or gradient: {first}"}
            if first != second:
                return {**row, "outcome": "failing",
                        "reason": f"the step is not deterministic: loss, gradient sum {first} then {second}"}
            if takes_media(inputs):
                stage = "text-only step"
                try:
                    text = training_inputs(model, batch=BATCH, seq=seq, generator=torch.Generator().manual_seed(1),
                                           with_images=False)
                except ExampleInputsError as error:
                    if "every batch" not in str(error):
                        raise
                    row["text_only"] = f"refused: {error}"  # the model needs images in every batch
                else:
                    row["text_inputs"] = sorted(text)
                    loss, grads = _step(model, text)
                    if not (math.isfinite(loss) and math.isfinite(grads)):
                        return {**row, "outcome": "failing", "reason": f"text-only: non-finite {loss, grads}"}
        except NoLoss as error:
            return {**row, "outcome": "skipped", "reason": f"transformers: {error}"}
        except ExampleInputsError as error:
            return {**row, "outcome": "no_inputs", "reason": f"{stage}: {_first_line(error)}"}
        except Exception as error:  # noqa: BLE001
            return failure_row(row, kind, arch, stage, error)
    return {**row, "outcome": "ok"}


def _fake_difference(model: torch.nn.Module, inputs: dict[str, Any], seq: int) -> str:
    """How the batch built for a fake copy of ``model`` (as the memory planner traces
    it: `annot.memory.activations.fake_copy`, called inside its ``FakeTensorMode``)
    differs from ``inputs``: a shape, the token ids, or the error; "" where it does not."""
    from annot.huggingface.example_inputs import training_inputs
    from annot.memory.activations import fake_copy

    copy, mode = fake_copy(model, None)
    try:
        with mode:
            fake = training_inputs(copy, batch=BATCH, seq=seq, generator=torch.Generator().manual_seed(1))
    except Exception as error:  # noqa: BLE001 - the row's reason
        return f"{_first_line(error)} at {_where(error)}"
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    fake_shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in fake.items()}
    if shapes != fake_shapes:
        return f"shapes {fake_shapes} instead of {shapes}"
    return ""


def seq_for(model: torch.nn.Module, training_inputs: Any) -> int:
    """`SEQ`, or more where the model's media need more placeholder tokens than it
    leaves room for (DeepSeek-OCR 2: 145 per image), as the builder's refusal says."""
    import re

    from annot.huggingface.example_inputs import ExampleInputsError

    try:
        training_inputs(model, batch=1, seq=SEQ)
    except ExampleInputsError as error:
        found = re.search(r"need seq > (\d+)", str(error))
        if found:
            return int(found.group(1)) + SEQ // 4
    return SEQ


def failure_row(row: dict[str, Any], kind: str, arch: str, stage: str, error: BaseException) -> dict[str, Any]:
    reason = f"{stage}: {_first_line(error)} at {_where(error)}"
    known = TRANSFORMERS_FAILURES.get((kind, arch))
    if known is not None and known[0] in str(error):
        return {**row, "outcome": "skipped", "reason": f"transformers fails a training step: {known[1]} ({reason})"}
    return {**row, "outcome": "failing", "reason": reason,
            "traceback": traceback.format_exception(error)[-1][-300:],
            "frames": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                       for f in traceback.extract_tb(error.__traceback__)][-6:]}


def read_rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The rows in ``path`` by (class, architecture); the last row of one wins."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(row["class"], row["arch"]): row for row in rows}


def summary(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    """A markdown table: the count per outcome of each class, then every row that is
    not ``ok`` with its reason."""
    import transformers

    lines = [f"transformers {transformers.__version__}", "",
             "| class | " + " | ".join(OUTCOMES) + " |", "|---|" + "---:|" * len(OUTCOMES)]
    for kind in CLASSES:
        by = collections.Counter(row["outcome"] for (k, _), row in rows.items() if k == kind)
        if by:
            lines.append(f"| {kind} | " + " | ".join(str(by.get(o, 0)) for o in OUTCOMES) + " |")
    lines.append("")
    for outcome in OUTCOMES[1:]:
        for (kind, arch), row in sorted(rows.items()):
            if row["outcome"] == outcome:
                lines.append(f"{outcome:9} {kind}/{arch}: {row.get('reason', '')[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.huggingface.probe_classes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="rows, one JSON object a line")
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {', '.join(CLASSES)}")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds for this call")
    parser.add_argument("--rerun", action="store_true", help="run the selection again even if --out has it")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the machine's other core may be busy; runs stay comparable
    kinds = args.classes.split(",")
    unknown = [k for k in kinds if k not in CLASSES]
    if unknown:
        parser.error(f"unknown classes {unknown}; choose from {', '.join(CLASSES)}")
    only = set(args.only.split(",")) if args.only else None
    todo = [(kind, arch, cls) for kind in kinds for arch, cls in architectures(kind).items()
            if only is None or arch in only]
    done = read_rows(args.out)
    if args.rerun:
        done = {key: row for key, row in done.items() if key not in {(k, a) for k, a, _ in todo}}
        args.out.write_text("".join(json.dumps(row) + "\n" for row in done.values()))
    start = time.monotonic()
    for kind, arch, cls in todo:
        if (kind, arch) in done:
            continue
        if time.monotonic() - start > args.budget:
            print("budget spent; run again for the rest", flush=True)
            break
        began = time.monotonic()
        try:
            with time_limit(ARCH_TIMEOUT_S):
                row = probe(kind, arch, cls)
        except TimeoutError as error:
            row = {"class": kind, "arch": arch, "model_class": cls, "outcome": "failing",
                   "reason": f"timed out: {error}"}
        row["seconds"] = round(time.monotonic() - began, 1)
        done[(kind, arch)] = row
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{kind}/{arch}: {row['outcome']} {row.get('reason', '')[:200]} ({row['seconds']} s)", flush=True)
    print(summary({key: row for key, row in done.items() if key[0] in kinds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
