"""Rows that train: FSDP2 parity, meta init, save/resume, fp16, DeepSpeed ZeRO-3 and
ZeRO-Offload.

Every comparison starts from the same values (a model built with the same seed) and
feeds the same batches; figures are the largest absolute differences over the losses of
every step and over every parameter at the end, gathered whole (``full_tensor``)."""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from annot.meta.deferred import meta_init
from annot.training_state import load_state, save_state
from annot.verify.context import Context
from annot.verify.model import Shape, TinyGPT, batches
from annot.verify.result import Row, fail_unless, skipped
from annot.wrap import auto_wrap

__all__ = ["ddp_parity_fp32", "deepspeed_zero3", "fp16_finite", "fsdp1_parity_fp32",
           "fsdp2_bf16_vs_fully_shard", "fsdp2_parity_fp32", "meta_init_bitwise",
           "save_resume_bitwise", "zero_offload_cpu_adam"]

STEPS = 4
BATCH = 4
FP32_BOUND = 1e-6


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole, on the CPU in fp32 (a DTensor gathered)."""
    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return whole.detach().float().cpu()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:6]}")
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose values differ in any bit."""
    return [n for n in a if not torch.equal(a[n], b[n])]


def step_losses(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any]) -> list[float]:
    """One optimizer step of ``model`` (whose forward returns the loss) per batch of
    ``data``; the losses."""
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_plain(model: nn.Module, data: list[Any]) -> list[float]:
    return step_losses(model, _adamw(model.parameters()), data)


def train_trainable(trainable: Any, data: list[Any]) -> list[float]:
    losses = []
    for x, y in data:
        loss = trainable(x, y)
        trainable.backward(loss)
        trainable.step()
        trainable.zero_grad()
        losses.append(loss.item())
    return losses


def _built(ctx: Context, shape: Shape, seed: int | None = None) -> TinyGPT:
    torch.manual_seed(ctx.seed if seed is None else seed)
    return TinyGPT(shape)


def _parity_fp32(ctx: Context, engine: str) -> Row:
    """One-rank ``engine`` (``auto_wrap``, the default Plan with checkpointing) against
    the plain model: losses and final parameters within 1e-6."""
    name = f"{engine}_parity_fp32"
    shape, data = Shape(), batches(Shape(), STEPS, BATCH, ctx.device)
    plain = _built(ctx, shape).to(ctx.device)
    wrapped = copy.deepcopy(plain)
    reference = train_plain(plain, data)
    trainable = auto_wrap(wrapped, engine, optimizer=_adamw, device=ctx.device)
    losses = train_trainable(trainable, data)
    loss_diff = max(abs(a - b) for a, b in zip(reference, losses, strict=True))
    # FSDP1 inserts its wrapper's name into every path: compare by the bare names.
    bare = {n.replace("_fsdp_wrapped_module.", "").removeprefix("module."): p
            for n, p in params_of(trainable.module).items()}
    param_diff = max_difference(params_of(plain), bare)
    return fail_unless(name, max(loss_diff, param_diff) <= FP32_BOUND,
                       f"{STEPS} AdamW steps, world 1 ({ctx.backend()}); bound {FP32_BOUND:g}",
                       max_loss_diff=loss_diff, max_param_diff=param_diff)


def fsdp2_parity_fp32(ctx: Context) -> Row:
    return _parity_fp32(ctx, "fsdp2")


def fsdp1_parity_fp32(ctx: Context) -> Row:
    """At world size 1 FSDP1 runs NO_SHARD: the path of a single-GPU job."""
    return _parity_fp32(ctx, "fsdp1")


def ddp_parity_fp32(ctx: Context) -> Row:
    return _parity_fp32(ctx, "ddp")


def fsdp2_bf16_vs_fully_shard(ctx: Context) -> Row:
    """``auto_wrap(..., mixed_precision="bf16")`` against the same model hand-wired with
    torch's ``fully_shard`` (each block, then the root; bf16 compute, fp32 reduce):
    bitwise equal losses and parameters."""
    from annot.engines.hand_wired import fully_shard_by_hand

    name = "fsdp2_bf16_vs_fully_shard"
    shape, data = Shape(), batches(Shape(), STEPS, BATCH, ctx.device)
    hand = _built(ctx, shape).to(ctx.device)
    ours = copy.deepcopy(hand)
    fully_shard_by_hand(hand, hand.blocks, torch.bfloat16)
    reference = train_plain(hand, data)
    trainable = auto_wrap(ours, "fsdp2", mixed_precision="bf16", checkpoint=False,
                          optimizer=_adamw, device=ctx.device)
    losses = train_trainable(trainable, data)
    differing = bitwise(params_of(hand), params_of(ours))
    same_losses = reference == losses
    return fail_unless(name, same_losses and not differing,
                       "bitwise: the same blocks as units, MixedPrecisionPolicy(bf16, reduce fp32)",
                       losses_equal=same_losses, differing_params=len(differing))


def meta_init_bitwise(ctx: Context) -> Row:
    """A model built under ``annot.meta_init`` inside ``with torch.device("cuda")`` (a
    constructor naming the GPU), sharded onto the device by FSDP2: every value bitwise
    the eager CPU build's with the same seed (docs/design.md, pitfall 33)."""
    name = "meta_init_bitwise"
    shape = Shape(layers=3)
    eager = params_of(_built(ctx, shape, seed=11))
    torch.manual_seed(11)
    with meta_init(), torch.device("cuda"):
        model = TinyGPT(shape)
    sharded = auto_wrap(model, "fsdp2", device=ctx.device)
    on_device = all(local.device.type == ctx.device.type for local in
                    (getattr(p, "_local_tensor", p) for p in sharded.parameters()))
    differing = bitwise(eager, params_of(sharded))
    return fail_unless(name, on_device and not differing,
                       "meta_init under torch.device('cuda') -> FSDP2 on the device vs eager CPU build",
                       differing_params=len(differing), params_on_device=on_device)


def save_resume_bitwise(ctx: Context) -> Row:
    """``save_state`` after 2 steps, 2 more steps; a fresh model ``load_state``-d runs
    the same 2 steps: bitwise equal losses and parameters. Dropout is on, so the RNG
    (the CUDA generator on a GPU) must come back too."""
    name = "save_resume_bitwise"
    shape = Shape(dropout=0.1)
    data = batches(shape, 4, BATCH, ctx.device)
    first = auto_wrap(_built(ctx, shape), "fsdp2", optimizer=_adamw, device=ctx.device)
    with tempfile.TemporaryDirectory(prefix="annot-verify-") as folder:
        train_trainable(first, data[:2])
        save_state(folder, first, step=2)
        expected = train_trainable(first, data[2:])
        torch.manual_seed(12345)  # the resumed run must not depend on the state at hand
        if ctx.cuda:
            torch.cuda.manual_seed_all(12345)
        second = auto_wrap(_built(ctx, shape, seed=99), "fsdp2", optimizer=_adamw, device=ctx.device)
        resumed = load_state(folder, second)
        got = train_trainable(second, data[2:])
    differing = bitwise(params_of(first.module), params_of(second.module))
    return fail_unless(name, expected == got and not differing and resumed.step == 2 and resumed.rng_restored,
                       "FSDP2, AdamW, dropout 0.1: 2 steps after save vs 2 steps after load",
                       losses_equal=expected == got, differing_params=len(differing),
                       rng_restored=resumed.rng_restored)


def fp16_finite(ctx: Context) -> Row:
    """FSDP2 with ``mixed_precision="fp16"`` (fp16 compute, fp32 shards and reduction)
    for 20 AdamW steps: every loss and every gradient finite."""
    name = "fp16_finite"
    if not ctx.cuda:
        return skipped(name, "needs --device cuda")
    shape = Shape()
    data = batches(shape, 20, BATCH, ctx.device)
    trainable = auto_wrap(_built(ctx, shape), "fsdp2", mixed_precision="fp16", optimizer=_adamw,
                          device=ctx.device)
    losses, bad_grads = [], 0
    for x, y in data:
        loss = trainable(x, y)
        trainable.backward(loss)
        bad_grads += sum(not bool(torch.isfinite(full(p.grad)).all())
                         for p in trainable.module.parameters() if p.grad is not None)
        trainable.step()
        trainable.zero_grad()
        losses.append(loss.item())
    finite = all(math.isfinite(v) for v in losses)
    return fail_unless(name, finite and bad_grads == 0, "20 steps, FSDP2 fp16 compute",
                       first_loss=losses[0], last_loss=losses[-1], nonfinite_grads=bad_grads)


def _deepspeed_against_plain(ctx: Context, name: str,
                             **options: Any) -> tuple[Any, float] | Row:
    """Train the plain model and a DeepSpeed copy (``auto_wrap`` with ``options``) on the
    same batches: the wrapped model and the largest loss difference, or the skipped row
    where the context cannot run DeepSpeed on a GPU."""
    if not ctx.cuda:
        return skipped(name, "needs --device cuda")
    if ctx.missing("deepspeed"):
        return skipped(name, "needs deepspeed (pip install 'annot-train[deepspeed]')")
    shape = Shape()
    data = batches(shape, STEPS, BATCH, ctx.device)
    plain = _built(ctx, shape).to(ctx.device)
    copied = copy.deepcopy(plain)
    reference = train_plain(plain, data)
    trainable = auto_wrap(copied, "deepspeed", checkpoint=False, optimizer=_adamw,
                          device=ctx.device, **options)
    losses = train_trainable(trainable, data)
    return trainable, max(abs(a - b) for a, b in zip(reference, losses, strict=True))


def deepspeed_zero3(ctx: Context) -> Row:
    """DeepSpeed ZeRO-3 through ``auto_wrap`` on one GPU against the plain model: losses
    within 1e-5 (fp32; DeepSpeed's flat buffers sum in another order)."""
    name, bound = "deepspeed_zero3", 1e-5
    ran = _deepspeed_against_plain(ctx, name, stage=3)
    if isinstance(ran, dict):  # the skipped row
        return ran
    _, loss_diff = ran
    return fail_unless(name, loss_diff <= bound, f"{STEPS} AdamW steps, world 1; bound {bound:g}",
                       max_loss_diff=loss_diff)


def zero_offload_cpu_adam(ctx: Context) -> Row:
    """DeepSpeed ZeRO-2 with the optimizer state on the host (``offload="cpu"``) on one
    GPU: the factory's torch AdamW steps as DeepSpeed's CPU Adam (built on first use),
    and the losses stay within 1e-5 of the plain model's (fp32)."""
    name, bound = "zero_offload_cpu_adam", 1e-5
    ran = _deepspeed_against_plain(ctx, name, stage=2, offload="cpu")
    if isinstance(ran, dict):  # the skipped row
        return ran
    trainable, loss_diff = ran
    host_optimizer = type(trainable.module.optimizer.optimizer).__name__  # ZeRO wraps it
    return fail_unless(name, host_optimizer == "DeepSpeedCPUAdam" and loss_diff <= bound,
                       f"the host step is DeepSpeedCPUAdam; {STEPS} steps, bound {bound:g}",
                       host_optimizer=host_optimizer, max_loss_diff=loss_diff)


TRAINING_ROWS: list[tuple[str, Callable[[Context], Row], bool]] = [
    # (name, row, needs CUDA)
    ("fsdp2_parity_fp32", fsdp2_parity_fp32, False),
    ("fsdp1_parity_fp32", fsdp1_parity_fp32, False),
    ("ddp_parity_fp32", ddp_parity_fp32, False),
    ("fsdp2_bf16_vs_fully_shard", fsdp2_bf16_vs_fully_shard, False),
    ("meta_init_bitwise", meta_init_bitwise, False),
    ("save_resume_bitwise", save_resume_bitwise, False),
    ("fp16_finite", fp16_finite, True),
]

#: Run after every other row: DeepSpeed's ZeRO-3 replaces ``F.linear`` for the whole
#: process (docs/design.md, pitfall 48), which moved a later eager model's fp32 losses
#: by 6.7e-4 over 3 SGD steps on the first H200 run (the same row without DeepSpeed
#: before it: 0.0).
DEEPSPEED_ROWS: list[tuple[str, Callable[[Context], Row], bool]] = [
    ("deepspeed_zero3", deepspeed_zero3, True),
    ("zero_offload_cpu_adam", zero_offload_cpu_adam, True),
]
