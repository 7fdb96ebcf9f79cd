"""Rows that count GPU memory: loading onto CUDA, the planner against the allocator,
activation offload. All need a CUDA device (``torch.cuda.max_memory_allocated``)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from annot.verify.context import Context
from annot.verify.model import Shape, TinyGPT, batches
from annot.verify.result import Row, fail_unless, skipped

__all__ = ["activation_offload", "from_pretrained_cuda", "planner_world1", "planner_world8_fake"]

MIB = 2**20
PLANNER_SHAPE = Shape(vocab=8192, block=256, layers=4, heads=8, width=512)
PLANNER_BATCH = 4
PLANNER_STRATEGIES = ("fsdp2", "fsdp2-no-reshard", "ddp", "fsdp1")
# The planner's figure against the allocator's peak: neither low by more than 10% (a
# plan that does not fit) nor high by more than 25% (a plan that wastes the GPU).
PLANNER_LOW, PLANNER_HIGH = 0.90, 1.25


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _needs_cuda(name: str, ctx: Context) -> Row | None:
    return None if ctx.cuda else skipped(name, "needs --device cuda")


def _pinned_read_floor(files: list[Path], device: torch.device) -> float:
    """Seconds to read ``files`` into pinned host memory and copy them to ``device``:
    what any loader of these bytes pays at least."""
    start = time.perf_counter()
    for file in files:
        size = file.stat().st_size
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        with open(file, "rb", buffering=0) as f:
            f.readinto(host.numpy().data)
        host.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def from_pretrained_cuda(ctx: Context) -> Row:
    """``annot.from_pretrained`` of a 0.7B-parameter Llama (bf16, 1.3 GiB) onto the GPU with FSDP2:
    peak allocated <= 1.02 x checkpoint bytes + 256 MiB; a warm load (the files in the
    page cache) <= 1.5 x the pinned-read floor of the same files."""
    name = "from_pretrained_cuda"
    if (row := _needs_cuda(name, ctx)) is not None:
        return row
    if ctx.missing("transformers", "safetensors"):
        return skipped(name, "needs transformers and safetensors (pip install 'annot-train[hf]')")
    import transformers

    from annot.huggingface.pretrained import from_pretrained

    # Large enough that reading the bytes, not building and planning the model, is most
    # of a load (the bound is relative to the read alone).
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8)
    with tempfile.TemporaryDirectory(prefix="annot-verify-") as folder:
        torch.manual_seed(0)
        source: Any = transformers.LlamaForCausalLM(config)
        source.to(torch.bfloat16).save_pretrained(folder)
        del source
        files = sorted(Path(folder).glob("*.safetensors"))
        checkpoint = sum(f.stat().st_size for f in files)
        times, peak = [], 0
        for _ in range(2):  # the first one warms the page cache (and CUDA kernels)
            ctx.fresh()
            start = time.perf_counter()
            model = from_pretrained(folder, "fsdp2", torch_dtype=torch.bfloat16, device=ctx.device)
            torch.cuda.synchronize(ctx.device)
            times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated(ctx.device)
            del model
        ctx.fresh()
        floor = min(_pinned_read_floor(files, ctx.device) for _ in range(3))
    memory_bound = 1.02 * checkpoint + 256 * MIB
    warm = times[-1]
    return fail_unless(name, peak <= memory_bound and warm <= 1.5 * floor,
                       "peak <= 1.02 x checkpoint + 256 MiB; warm load <= 1.5 x pinned-read floor",
                       checkpoint_mib=checkpoint / MIB, peak_mib=peak / MIB, warm_load_s=warm,
                       cold_load_s=times[0], floor_s=floor, load_over_floor=warm / floor)


def _predicted(key: str, world: int) -> int:
    """The planner's device peak for ``key`` at ``world`` ranks, fp32, AdamW, no checkpointing."""
    from annot.memory.activations import trace_step
    from annot.memory.engine_memory import model_facts
    from annot.memory.report import strategy_memory
    from annot.memory.strategies import strategy
    from annot.planning import plan as make_plan

    with torch.device("meta"):
        meta = TinyGPT(PLANNER_SHAPE)
    plan = make_plan(meta)
    trace = trace_step(meta, plan, batch=PLANNER_BATCH, seq=PLANNER_SHAPE.block, checkpoint=False)
    memory = strategy_memory(strategy(key), trace, model_facts(meta, plan), plan, world=world,
                             precision="fp32", optimizer="adamw")
    return memory.device


def _measured(ctx: Context, key: str) -> int:
    """The allocator's peak over 3 training steps of ``key`` (from an empty GPU)."""
    from annot.memory.strategies import strategy
    from annot.meta.deferred import meta_init
    from annot.wrap import auto_wrap

    chosen = strategy(key)
    ctx.fresh()
    base = torch.cuda.memory_allocated(ctx.device)
    torch.manual_seed(0)
    with meta_init():
        model = TinyGPT(PLANNER_SHAPE)
    trainable = auto_wrap(model, chosen.engine, checkpoint=False, optimizer=_adamw, device=ctx.device,
                          **chosen.engine_options("fp32"))
    torch.cuda.reset_peak_memory_stats(ctx.device)
    for x, y in batches(PLANNER_SHAPE, 3, PLANNER_BATCH, ctx.device):
        loss = trainable(x, y)
        trainable.backward(loss)
        trainable.step()
        trainable.zero_grad()
        del loss
    torch.cuda.synchronize(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - base
    del trainable, model
    ctx.fresh()
    return peak


def planner_world1(ctx: Context) -> Row:
    """The planner's per-rank device figure against ``torch.cuda.max_memory_allocated``
    for each strategy at world size 1 (a 17M-parameter GPT, fp32, AdamW)."""
    name = "planner_world1"
    if (row := _needs_cuda(name, ctx)) is not None:
        return row
    figures: dict[str, float] = {}
    for key in PLANNER_STRATEGIES:
        predicted, measured = _predicted(key, 1), _measured(ctx, key)
        label = key.replace("-", "_")
        figures[f"ratio_{label}"] = predicted / measured
        figures[f"predicted_mib_{label}"] = predicted / MIB
        figures[f"measured_mib_{label}"] = measured / MIB
    ok = all(PLANNER_LOW <= v <= PLANNER_HIGH for k, v in figures.items() if k.startswith("ratio_"))
    return fail_unless(name, ok, f"planner / allocator peak within [{PLANNER_LOW}, {PLANNER_HIGH}]",
                       **figures)


def planner_world8_fake(ctx: Context) -> Row:
    """FSDP2 at world size 8 through torch's fake process group (collectives do nothing,
    every shard a real CUDA allocation of rank 0's size): the planner's figure against
    the allocator's peak."""
    name = "planner_world8_fake"
    if (row := _needs_cuda(name, ctx)) is not None:
        return row
    predicted = _predicted("fsdp2", 8)
    with ctx.fake_group(8):
        measured = _measured(ctx, "fsdp2")
    ratio = predicted / measured
    return fail_unless(name, PLANNER_LOW <= ratio <= PLANNER_HIGH,
                       f"FSDP2, 8 fake ranks; planner / allocator peak within [{PLANNER_LOW}, {PLANNER_HIGH}]",
                       predicted_mib=predicted / MIB, measured_mib=measured / MIB, ratio=ratio)


def _held_after_forward(ctx: Context, offload: bool) -> tuple[int, int, float, dict[str, int]]:
    """(bytes a forward leaves held for backward, bytes offloaded, mean step seconds,
    the offloader's last-step counters) of a one-rank FSDP2 GPT with or without
    activation offload."""
    from annot.meta.deferred import meta_init
    from annot.runtime.activation_offload import activation_offloader
    from annot.wrap import auto_wrap

    shape = Shape(vocab=8192, block=512, layers=6, heads=8, width=768)
    ctx.fresh()
    torch.manual_seed(0)
    with meta_init():
        model = TinyGPT(shape)
    trainable = auto_wrap(model, "fsdp2", checkpoint=False, offload_activations=offload,
                          optimizer=_adamw, device=ctx.device)
    data = batches(shape, 4, 8, ctx.device)
    held, seconds = 0, []
    for i, (x, y) in enumerate(data):
        offloader = activation_offloader(model)
        if offloader is not None:
            offloader.reset_counters()
        torch.cuda.synchronize(ctx.device)
        start, before = time.perf_counter(), torch.cuda.memory_allocated(ctx.device)
        loss = trainable(x, y)
        held = torch.cuda.memory_allocated(ctx.device) - before
        trainable.backward(loss)
        trainable.step()
        trainable.zero_grad()
        torch.cuda.synchronize(ctx.device)
        if i:  # the first step warms up
            seconds.append(time.perf_counter() - start)
    offloaded = offloader.packed_bytes if offloader is not None else 0
    counters = {} if offloader is None else {
        "tensors": offloader.packed_tensors, "prefetched": offloader.prefetched_tensors,
        "buffers_made": offloader.buffers_made, "buffers_reused": offloader.buffers_reused}
    del trainable, model
    return held, offloaded, sum(seconds) / len(seconds), counters


def _copy_seconds(ctx: Context, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` to pinned host memory and back, alone."""
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize(ctx.device)
    start = time.perf_counter()
    host.copy_(device_buffer, non_blocking=True)
    device_buffer.copy_(host, non_blocking=True)
    torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


def activation_offload(ctx: Context) -> Row:
    """``auto_wrap(..., offload_activations=True)``: the memory a forward leaves held for
    backward drops by >= 0.8 x the bytes offloaded; reported too: how much of the copy
    time the step hides (1: all of it, 0: none), the last step's tensors offloaded and
    copied back ahead of backward, and the host buffers made and reused over the run."""
    name = "activation_offload"
    if (row := _needs_cuda(name, ctx)) is not None:
        return row
    held_plain, _, step_plain, _ = _held_after_forward(ctx, offload=False)
    held_offload, offloaded, step_offload, counters = _held_after_forward(ctx, offload=True)
    saved = held_plain - held_offload
    copy = _copy_seconds(ctx, max(offloaded, 1))
    hidden = 1.0 - (step_offload - step_plain) / copy if copy > 0 else 0.0
    return fail_unless(name, offloaded > 0 and saved >= 0.8 * offloaded,
                       "held after forward: saved >= 0.8 x offloaded bytes",
                       offloaded_mib=offloaded / MIB, saved_mib=saved / MIB,
                       step_s=step_plain, step_offload_s=step_offload, copy_s=copy,
                       copy_hidden=max(0.0, min(1.0, hidden)),
                       **{f"offload_{key}": value for key, value in counters.items()})


MEMORY_ROWS: list[tuple[str, Callable[[Context], Row], bool]] = [
    ("from_pretrained_cuda", from_pretrained_cuda, True),
    ("planner_world1", planner_world1, True),
    ("planner_world8_fake", planner_world8_fake, True),
    ("activation_offload", activation_offload, True),
]
