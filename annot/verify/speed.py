"""Rows about compiled and timed training: ``torch.compile`` of checkpointed blocks,
throughput against a hand-wired FSDP2 loop."""

from __future__ import annotations

import copy
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from annot.verify.context import Context
from annot.verify.model import Shape, TinyGPT, batches, flops_per_token
from annot.verify.result import Row, fail_unless, skipped
from annot.verify.training import step_losses
from annot.wrap import auto_wrap

__all__ = ["compile_checkpointed_blocks", "throughput_vs_hand_wired"]

# Dense bf16 peak FLOP/s of the GPUs MFU is reported for (vendor data sheets, SXM).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def compile_checkpointed_blocks(ctx: Context) -> Row:
    """FSDP2 with every block checkpointed (``auto_wrap(..., checkpoint=True)``), each
    block then compiled with ``fullgraph=True`` (inductor on CUDA; AOTAutograd with
    eager kernels on the CPU, where no C++ toolchain is assumed): 0 graph breaks
    (dynamo's counters) over 3 training steps, and losses within 1e-5 both of eager and
    of the same blocks compiled without annot (``max_loss_diff``: what annot adds,
    sharding and checkpointing, under the compiler). Eager must not run after a
    DeepSpeed row: its ``F.linear`` stays replaced (`annot.verify.training.DEEPSPEED_ROWS`)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    name = "compile_checkpointed_blocks"
    bound = 1e-5
    shape = Shape()
    data = batches(shape, 3, 4, ctx.device)
    torch.manual_seed(ctx.seed)
    eager = TinyGPT(shape).to(ctx.device)
    plain_compiled = copy.deepcopy(eager)
    compiled = cast(TinyGPT, auto_wrap(copy.deepcopy(eager), "fsdp2", checkpoint=True, device=ctx.device))
    backend = "inductor" if ctx.cuda else "aot_eager"

    def losses(model: nn.Module) -> list[float]:
        return step_losses(model, torch.optim.SGD(model.parameters(), lr=0.1), data)

    def compiled_losses(model: TinyGPT) -> tuple[list[float], int, int]:
        """Losses, graph breaks and graphs of ``model`` with each block compiled."""
        torch._dynamo.reset()
        counters.clear()
        for block in model.blocks:
            block.compile(fullgraph=True, backend=backend)
        got = losses(model)
        return got, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]

    expected = losses(eager)
    reference, _, _ = compiled_losses(plain_compiled)
    got, breaks, frames = compiled_losses(compiled)
    torch._dynamo.reset()
    diff = max(abs(a - b) for a, b in zip(reference, got, strict=True))
    eager_diff = max(abs(a - b) for a, b in zip(expected, got, strict=True))
    return fail_unless(name, breaks == 0 and frames > 0 and max(diff, eager_diff) <= bound,
                       f"backend {backend}; 0 graph breaks, loss within {bound:g} of eager and of "
                       "the blocks compiled without annot", graph_breaks=breaks, graphs=frames,
                       max_loss_diff=diff, eager_loss_diff=eager_diff)


def _example_model(shape: Shape) -> tuple[nn.Module, Callable[[nn.Module, Any, Any], torch.Tensor], str]:
    """The example GPT (``examples/gpt``, in a checkout) in ``shape``, or this package's
    TinyGPT where the examples are not importable; with how to get its loss."""
    try:
        # By name: the examples are a checkout's, not part of the package (nor its types).
        GPT = importlib.import_module("examples.gpt.model").GPT
    except ImportError:
        return TinyGPT(shape), lambda m, x, y: m(x, y), "annot.verify TinyGPT"
    model = GPT(n_layer=shape.layers, n_head=shape.heads, n_embd=shape.width,
                vocab_size=shape.vocab, block_size=shape.block)
    return model, lambda m, x, y: m(x, y)[1], "examples.gpt GPT"


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the example GPT (or TinyGPT): the units to shard."""
    return [m for m in model.modules() if m is not model and type(m).__name__ == "Block"]


def _step_seconds(model: nn.Module, optimizer: torch.optim.Optimizer, loss_of: Any,
                  batch: Any, ctx: Context) -> float:
    """One training step of ``model``, timed from an idle device to an idle device."""
    x, y = batch
    ctx.synchronize()
    start = time.perf_counter()
    loss_of(model, x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    ctx.synchronize()
    return time.perf_counter() - start


STEPS_TIMED = 30


def throughput_vs_hand_wired(ctx: Context) -> Row:
    """Tokens/s and MFU of the example GPT (GPT-2 small's shape, bf16 compute) trained
    through ``auto_wrap(..., "fsdp2")`` against the same model hand-wired with torch's
    ``fully_shard`` and the same loop: annot's median step time <= 1.02 x the hand-wired
    one. The models take turns step by step (the order rotating), so that a drift of the
    GPU's speed over the run falls on all alike: on the first H200 runs, rounds of 10
    steps each drifted from 43 to 63 ms. A second hand-wired copy measures the method's
    own spread (``noise_ratio``: the copy's median over the first's)."""
    from annot.engines.hand_wired import fully_shard_by_hand

    name = "throughput_vs_hand_wired"
    if not ctx.cuda:
        return skipped(name, "needs --device cuda")
    shape = Shape(vocab=50304, block=1024, layers=12, heads=12, width=768)
    batch = 8
    torch.manual_seed(ctx.seed)
    hand, loss_of, which = _example_model(shape)
    hand = hand.to(ctx.device)
    models = {"hand": hand, "hand_copy": copy.deepcopy(hand), "annot": copy.deepcopy(hand)}
    units = _blocks(hand)
    for key in ("hand", "hand_copy"):
        fully_shard_by_hand(models[key], _blocks(models[key]), torch.bfloat16)
    auto_wrap(models["annot"], "fsdp2", mixed_precision="bf16", checkpoint=False, device=ctx.device)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for k, m in models.items()}
    data = batches(shape, STEPS_TIMED, batch, ctx.device)
    keys = list(models)
    for key in keys:  # warm-up: kernels chosen, allocator filled, optimizer states made
        for step in data[:3]:
            _step_seconds(models[key], optimizers[key], loss_of, step, ctx)
    seconds: dict[str, list[float]] = {k: [] for k in keys}
    for i, step in enumerate(data):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            seconds[key].append(_step_seconds(models[key], optimizers[key], loss_of, step, ctx))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    tokens = batch * shape.block
    per_token = flops_per_token(hand, shape)
    gpu = torch.cuda.get_device_name(ctx.device)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu), None)
    ratio = median["annot"] / median["hand"]
    figures: dict[str, Any] = {
        "model": which, "units": len(units), "tokens_per_s": tokens / median["annot"],
        "hand_tokens_per_s": tokens / median["hand"], "step_ratio": ratio,
        "noise_ratio": median["hand_copy"] / median["hand"], "gpu": gpu,
        "mfu": per_token * tokens / median["annot"] / peak if peak else None,
        "hand_mfu": per_token * tokens / median["hand"] / peak if peak else None,
    }
    return fail_unless(name, ratio <= 1.02 and len(units) == shape.layers,
                       f"annot's median step time <= 1.02 x hand-wired fully_shard ({STEPS_TIMED} "
                       "steps each, taking turns)", **figures)


SPEED_ROWS: list[tuple[str, Callable[[Context], Row], bool]] = [
    ("compile_checkpointed_blocks", compile_checkpointed_blocks, False),
    ("throughput_vs_hand_wired", throughput_vs_hand_wired, True),
]
