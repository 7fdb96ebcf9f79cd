"""The two stages of the class sweep (tests/huggingface/sweep_classes.py), one case each:
``CLASS/NAME``, a transformers architecture of one of the class probe's mappings
(tests/huggingface/probe_classes.py: ``image_text/qwen2_vl``, ``seq2seq/t5``, ...) or a
diffusers transformer class (``diffusers/FluxTransformer2DModel``).

`prepare` runs in one process, before any launch. It builds the tiny model from the
fixed seed and saves it into PREPARED/CASE (transformers: the mapping's class,
``save_pretrained`` into that folder; diffusers: the class, saved as the ``transformer``
component of the pipeline folder PREPARED/CASE/pipeline, whose ``model_index.json``
names it), makes each rank's batch (2 ranks; a model that takes images or audio gets
them on both, and for the ``mixed`` scenario rank 1 gets a text-only batch where the
inputs builder gives one), and takes the reference: the library's own
``from_pretrained`` (the mapping's class; the diffusers class), training mode, one step
per rank's batch, the mean loss and mean gradients (what data parallelism computes: a
parameter a batch gives no gradient counts zero in that batch's term) and the trainable
names (a model with batch norm or with query tokens of zeros: all in float64,
`DOUBLE_REASON`, `ZERO_INPUT_REASON`). Then ``annot plan DIR``
and ``annot plan DIR --memory --seq S --batch B`` (B: each rank's batch) in that process
(DIR: the model folder, or the pipeline folder). A case that cannot get this far ends
there: skipped where the library itself fails or the inputs builder refuses (the
probes' classification), failing where annot's inputs builder crashes or the library's
step fails on the batch the builder made.

This file's main runs under torchrun on 2 CPU ranks (`sweep_worker.serve`: one launch
for many cases, a row each as it ends)::

    python -m torch.distributed.run --nproc_per_node 2 sweep_classes_worker.py ROWS PREPARED BUDGET_S CASE...

For each case: ``annot.from_pretrained(DIR, "fsdp2", device="cpu")`` plain and with
``checkpoint=True``, one step on this rank's batch, and where there is a text-only batch
``mixed`` (rank 0 with images, rank 1 text only, checkpointed as the multimodal tests'
mixed scenario), each compared with its reference as the causal-LM sweep compares
(`sweep_worker.compare`: loss within 1e-5 relative, every gradient within 1e-4 absolute,
equal trainable sets), plus no non-zero gradient the reference lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.huggingface.sweep_worker import (
    REFERENCE,
    _first_line,
    _is_moe,
    _where,
    classify,
    compare,
    gathered_step,
    plan_command,
    run_scenario,
    serve,
)

Row = dict[str, Any]
Batch = Any  # a forward's keyword arguments; for a denoiser, (keyword arguments, target)
Step = tuple[float, dict[str, torch.Tensor], list[str]]

DIFFUSERS = "diffusers"
SEED = 0  # the tiny model's weights
ROWS_PER_RANK = 2  # samples in each rank's batch
PIPELINE = "pipeline"
BATCHES = "sweep-batches.pt"
STEP_SEED = 7  # the global generator's seed before every step: a forward that draws draws the same
BATCH_SEED = 100  # rank r's batch: generator seed BATCH_SEED + r
PREPARE_TIMEOUT_S = 600  # one case's build, batches and reference steps
PLAN_TIMEOUT_S = 600  # each plan command
# --seq of a denoiser's plan: its trace is sized by denoiser_inputs' latents, not by this
PLAN_SEQ_DIFFUSERS = 64
#: Scenario label -> from_pretrained's options; the batches and reference it takes are
#: the ones saved under the same label (``mixed``: only where there is a text-only batch).
SCENARIOS: dict[str, dict[str, Any]] = {
    "fsdp2": {}, "fsdp2_checkpoint": {"checkpoint": True}, "mixed": {"checkpoint": True}}
_SAME_BATCHES = {"fsdp2_checkpoint": "fsdp2"}


def split_case(case: str) -> tuple[str, str]:
    """``CLASS/NAME`` -> (class, name)."""
    kind, _, name = case.partition("/")
    return kind, name


def model_folder(directory: Path, kind: str) -> Path:
    """What ``annot.from_pretrained`` and ``annot plan`` read for a case prepared in
    ``directory``: the pipeline folder of a denoiser, the model folder otherwise."""
    return directory / PIPELINE if kind == DIFFUSERS else directory


def quiet() -> None:
    """transformers' progress bars and info lines off: a sweep prints a line per case."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# -- the steps


def hf_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """A transformers model's loss on its batch (labels included); `Skipped` where the
    forward returns none (ShieldGemma-2's classifier returns probabilities only)."""
    from tests.huggingface.probe_classes import Skipped

    loss = model(**batch).loss
    if loss is None:
        raise Skipped(f"transformers: {type(model).__name__}.forward returns no loss for its labels")
    return loss


def denoiser_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """A diffusers denoiser's flow-matching loss on ``(inputs, target)``."""
    from annot.huggingface.denoiser_inputs import flow_matching_loss

    inputs, target = batch
    return flow_matching_loss(model, inputs, target)


def loss_function(kind: str) -> Callable[[torch.nn.Module, Batch], torch.Tensor]:
    return denoiser_loss if kind == DIFFUSERS else hf_loss


def reference_step(load: Callable[[], torch.nn.Module], loss_of: Callable[[torch.nn.Module, Batch], torch.Tensor],
                   batch: Batch) -> Step:
    """One step of a freshly loaded model in training mode on ``batch``: the loss, every
    gradient by name, the trainable names. Raises what the step raises, and
    FloatingPointError on a non-finite loss. On one thread, as the workers compute
    (`sweep_worker.serve`): a convolution's sums are ordered by the thread count, and a
    batch norm over a two-image batch magnifies the difference (plain transformers
    alone, from one thread to two: HGNet-V2's loss 2.6% apart, ResNet's stem gradient
    0.08)."""
    model = load().train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(STEP_SEED)
        loss = loss_of(model, batch)
        loss.backward()
    finally:
        torch.set_num_threads(threads)
    if not torch.isfinite(loss.detach()).all():
        raise FloatingPointError(f"a non-finite loss {loss.item()}")
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, [n for n, p in model.named_parameters() if p.requires_grad]


def data_parallel_mean(steps: list[Step]) -> Step:
    """What data parallelism computes from one step per rank: the mean loss and the mean
    gradient, a parameter without a gradient in a step counting zero there (a text-only
    batch leaves the vision tower without one). The trainable names are the first's."""
    grads: dict[str, torch.Tensor] = {}
    for _, step_grads, _ in steps:
        for name, grad in step_grads.items():
            grads[name] = grads.get(name, torch.zeros_like(grad)) + grad
    return (sum(loss for loss, _, _ in steps) / len(steps),
            {name: grad / len(steps) for name, grad in grads.items()}, steps[0][2])


def compare_whole(ref: Step, got: tuple[float, dict[str, torch.Tensor | None], list[str]]) -> dict[str, Any]:
    """`sweep_worker.compare`, and no gradient the reference lacks may be non-zero."""
    out = compare(ref, got)
    if "difference" not in out:
        extra = sorted(n for n, g in got[1].items() if n not in ref[1] and g is not None and bool(g.abs().max() > 0))
        if extra:
            out["difference"] = f"non-zero gradients the reference has not: {extra[:5]}"
    return out


# -- prepare: transformers


def _hf_batches(model: torch.nn.Module, seq: int, row: Row) -> dict[str, list[Batch]]:
    """Each scenario's batch per rank: ``fsdp2`` (media on both ranks where the model
    takes them) and, for a model taking media, ``mixed`` (rank 1 text only) where the
    builder gives a batch without media; else ``row["mixed_skipped"]`` says why not.
    Raises what `training_inputs` raises for the ``fsdp2`` batches."""
    from annot.huggingface.example_inputs import ExampleInputsError, training_inputs
    from tests.huggingface.probe_classes import takes_media

    def rank_batch(rank: int, images: bool = True) -> Batch:
        return training_inputs(model, batch=ROWS_PER_RANK, seq=seq, with_images=images,
                               generator=torch.Generator().manual_seed(BATCH_SEED + rank))

    batches = {"fsdp2": [rank_batch(0), rank_batch(1)]}
    if not takes_media(batches["fsdp2"][0]):
        return batches
    try:
        text = rank_batch(1, images=False)
    except ExampleInputsError as error:
        row["mixed_skipped"] = f"the inputs builder refuses a text-only batch: {_first_line(error)}"
        return batches
    if takes_media(text):  # an image classifier's "text-only" batch still holds its images
        row["mixed_skipped"] = f"the inputs builder's text-only batch holds media: {sorted(text)}"
    else:
        batches["mixed"] = [batches["fsdp2"][0], text]
    return batches


def _hf_prepare(kind: str, arch: str, directory: Path) -> Row:
    """Build, save, batches and reference of a transformers case; the row so far
    (``outcome`` None where the launch decides)."""
    import transformers

    from annot.huggingface.example_inputs import ExampleInputsError, training_inputs
    from tests.huggingface.probe_classes import (
        Skipped,
        architectures,
        failure_row,
        seq_for,
        tiny_model,
    )

    class_name = architectures(kind)[arch]
    row: Row = {"model_class": class_name, "outcome": None}
    try:
        model = tiny_model(kind, arch, class_name, directory)
    except Skipped as error:
        return {**row, "outcome": "skipped", "reason": str(error)}
    row["params"] = sum(p.numel() for p in model.parameters())
    row["moe"] = _is_moe(model.config) or _is_moe(model.config.get_text_config())
    try:
        row["seq"] = seq_for(model, training_inputs)
        batches = _hf_batches(model, row["seq"], row)
    except ExampleInputsError as error:
        return {**row, "outcome": "skipped", "reason": f"the inputs builder refuses it: {_first_line(error)}"}
    except Exception as error:  # noqa: BLE001 - annot's builder crashed: the probe's failure
        return failure_row(row, kind, arch, "the inputs builder", error)
    cls = getattr(transformers, class_name)
    lost = _lost_in_round_trip(cls, directory)
    if lost:
        return {**row, "outcome": "skipped", "reason": f"transformers fails to load its own save: {lost}"}
    options: dict[str, Any] = {}
    double = _double_reason(model)
    if double:
        row["dtype"], row["dtype_reason"], options = "float64", double, {"dtype": torch.float64}
        batches = {label: [_in_double(b) for b in scenario] for label, scenario in batches.items()}
    refs = _references(lambda: cls.from_pretrained(directory, **options), hf_loss, batches)
    if isinstance(refs, Skipped):
        return {**row, "outcome": "skipped", "reason": str(refs)}
    if isinstance(refs, BaseException):
        return failure_row(row, kind, arch, "the reference step", refs)
    _save(directory, batches, refs)
    return row


def _in_double(batch: Batch) -> Batch:
    """``batch`` with its floating tensors in float64 (`DOUBLE_REASON`)."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


#: Why a model with batch norm is compared in float64: trained on two images a rank it
#: magnifies float32 rounding by up to 1e9 (gradients of 2e9 in HGNet-V2), and plain
#: transformers alone moved MobileNet-V2's stem gradient by 0.23 when its parameters
#: only moved in memory (as FSDP2's gathered ones are, views into one flat buffer), by
#: 0.08 in ResNet from one thread to two: in float32 the reference is not a reference.
DOUBLE_REASON = "batch norm over a two-image batch magnifies float32 rounding past any bound"

#: Why a model whose Q-Former query tokens are zeros is compared in float64: InstructBLIP's
#: enter a layer norm with zero variance, whose backward multiplies by 1/sqrt(eps) = 1e6.
#: FSDP2's hook at a unit's input changes the order autograd adds a shared activation's
#: four gradients in: one ulp there (measured, world size 1) became 1.1e-5 of the query
#: tokens' gradient. Only the query tokens: other zero parameters (DeepSeek-OCR 2's
#: position tables, ERNIE-VL's routing statics) feed no norm, and grouped experts have no
#: float64 kernel.
ZERO_INPUT_REASON = "query tokens of zeros, layer-normed, magnify float32 rounding by 1/sqrt(eps)"


def _double_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` is compared in float64 (`DOUBLE_REASON`, `ZERO_INPUT_REASON`), or None."""
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return DOUBLE_REASON
    if any(name.endswith("query_tokens") and not p.any() for name, p in model.named_parameters()):
        return ZERO_INPUT_REASON
    return None


def _lost_in_round_trip(cls: type, directory: Path) -> str:
    """Empty, or what says that ``cls.from_pretrained`` of the save in ``directory``
    reads it under other names: weights missing and checkpoint keys unused at once
    (ShieldGemma-2's image-text class misses the language model its classification
    model wrote under another prefix). A reference with those weights at random values
    compares nothing. Keys missing alone are what transformers re-creates (Marian's
    tables) and stay the launch's to compare."""
    _, info = cls.from_pretrained(directory, output_loading_info=True)
    missing, unused = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if not (missing and unused):
        return ""
    return f"{len(missing)} weights missing (e.g. {missing[0]}) and {len(unused)} keys unused (e.g. {unused[0]})"


def _references(load: Callable[[], torch.nn.Module], loss_of: Callable[[torch.nn.Module, Batch], torch.Tensor],
                batches: dict[str, list[Batch]]) -> dict[str, Step] | BaseException:
    """Each scenario's reference (`data_parallel_mean` of one step per rank's batch,
    a batch two scenarios share stepped once), or the error a step raised."""
    steps: dict[int, Step] = {}
    try:
        for scenario in batches.values():
            for batch in scenario:
                if id(batch) not in steps:
                    steps[id(batch)] = reference_step(load, loss_of, batch)
    except TimeoutError:  # `prepare`'s time limit: a hang, not a failing step
        raise
    except Exception as error:  # noqa: BLE001 - the caller classifies it
        return error
    return {label: data_parallel_mean([steps[id(b)] for b in scenario]) for label, scenario in batches.items()}


def _save(directory: Path, batches: dict[str, list[Batch]], refs: dict[str, Step]) -> None:
    torch.save(batches, directory / BATCHES)
    torch.save(refs, directory / REFERENCE)


# -- prepare: diffusers


def _diffusers_prepare(name: str, directory: Path) -> Row:
    """Build, save (a pipeline folder around the component), batches and reference of a
    diffusers denoiser; the row so far."""
    from annot.huggingface.denoiser_inputs import denoiser_inputs
    from tests.huggingface.diffusers_configs import tiny_denoiser_config, transformer_classes
    from tests.huggingface.diffusers_models import save_in_pipeline
    from tests.huggingface.probe_denoisers import (
        DIFFUSERS_FAILURES,
        batch_size,
        flex_backward_reason,
    )

    cls = transformer_classes()[name]
    row: Row = {"model_class": name, "outcome": None}
    try:
        torch.manual_seed(SEED)
        component = save_in_pipeline(cls.from_config(tiny_denoiser_config(name)), directory / PIPELINE)
        model = cls.from_pretrained(component)
    except Exception as error:  # noqa: BLE001 - the reason
        return {**row, "outcome": "skipped",
                "reason": f"diffusers fails to build, save or load it: {_first_line(error)} at {_where(error)}"}
    row["params"] = sum(p.numel() for p in model.parameters())
    try:
        row["batch"] = batch_size(model)
        batches = {"fsdp2": [denoiser_inputs(model, batch=row["batch"],
                                             generator=torch.Generator().manual_seed(BATCH_SEED + rank))
                             for rank in range(2)]}
    except ValueError as error:  # the builder's refusal of a class it does not serve
        return {**row, "outcome": "skipped", "reason": f"the inputs builder refuses it: {_first_line(error)}"}
    except Exception as error:  # noqa: BLE001
        return {**row, "outcome": "failing", "reason": f"the inputs builder: {_first_line(error)} at {_where(error)}"}
    refs = _references(lambda: cls.from_pretrained(component), denoiser_loss, batches)
    if isinstance(refs, BaseException):
        known = flex_backward_reason(name, refs) or DIFFUSERS_FAILURES.get(name)
        if known:
            return {**row, "outcome": "skipped", "reason": f"diffusers fails a training step: {known}"}
        return {**row, "outcome": "failing",
                "reason": f"the reference step: {_first_line(refs)} at {_where(refs)}"}
    _save(directory, batches, refs)
    return row


def prepare(case: str, directory: Path) -> Row:
    """The single-process part of one case (see the module's text); the row so far: its
    ``outcome`` is None where the launch decides, else skipped or failing with the
    reason."""
    from tests.huggingface.probe_classes import time_limit

    quiet()
    kind, name = split_case(case)
    row: Row = {"case": case, "class": kind, "arch": name}
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with time_limit(PREPARE_TIMEOUT_S):
            row.update(_diffusers_prepare(name, directory) if kind == DIFFUSERS else _hf_prepare(kind, name, directory))
    except TimeoutError as error:
        return {**row, "outcome": "failing", "reason": f"timed out preparing it: {error}"}
    if row["outcome"] is not None:
        return row
    target = model_folder(directory, kind)
    seq = str(row.get("seq", PLAN_SEQ_DIFFUSERS))
    # --batch as each rank trains: a batch norm cannot train on one sample (ResNet, ...)
    batch = str(row.get("batch", ROWS_PER_RANK))
    for key, extra in (("plan", ()), ("plan_memory", ("--memory", "--seq", seq, "--batch", batch))):
        with time_limit(PLAN_TIMEOUT_S):  # its TimeoutError is the command's crash (plan_command)
            row[key] = plan_command(target, *extra)
    return row


# -- train: the 2-rank part


def annot_step(target: Path, loss_of: Callable[[torch.nn.Module, Batch], torch.Tensor], batch: Batch,
               **options: Any) -> tuple[float, dict[str, torch.Tensor | None], list[str]]:
    """annot.from_pretrained of ``target`` on this group, one step on this rank's
    ``batch``: `sweep_worker.gathered_step`'s figures."""
    import annot

    model = annot.from_pretrained(target, "fsdp2", device="cpu", **options)
    torch.manual_seed(STEP_SEED)
    return gathered_step(model, loss_of(model, batch))


def run_case(prepared: Row, directory: Path) -> Row:
    """The 2-rank part of one prepared case, on every rank: each scenario's step
    compared with its reference; the final row."""
    import torch.distributed as dist

    quiet()
    row = dict(prepared)
    kind, _ = split_case(row["case"])
    batches = torch.load(directory / BATCHES, weights_only=False)
    refs = torch.load(directory / REFERENCE, weights_only=False)
    rank, loss_of, target = dist.get_rank(), loss_function(kind), model_folder(directory, kind)
    labels = [label for label in SCENARIOS if _SAME_BATCHES.get(label, label) in batches]
    dtype = {"torch_dtype": torch.float64} if row.get("dtype") == "float64" else {}  # _double_reason
    for label in labels:
        source = _SAME_BATCHES.get(label, label)
        row[label] = run_scenario(
            lambda options={**SCENARIOS[label], **dtype}, source=source: compare_whole(
                refs[source], annot_step(target, loss_of, batches[source][rank], **options)),
            row.get("moe", False))
    row["scenarios"] = labels
    row["outcome"], row["reason"] = classify(row, labels)
    return row


if __name__ == "__main__":
    serve(run_case)
