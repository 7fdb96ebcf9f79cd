"""The planner prices float8 by tracing torchao's float8 linears: their casts, scales and
what they save for backward. Checked against live tensor bytes counted on 2 CPU ranks
(memory_worker.py: a bf16 Llama, 3 AdamW steps, with and without float8).

Each row is asserted within 5% of its count, and the planner's difference between the
bf16 and the float8 step within 5% of the counted difference. Measured (2 x 256 tokens
per rank): DDP's difference is the counted one to the byte; FSDP2's is +917,004 B
against +917,060 B counted (tensorwise, float8 all-gather) and +2,695,680 B against
+2,695,680 B (rowwise), each row within 300 B of its count. FSDP2's rows need the
trace to start a unit's backward where backward enters it (a gradient of its output),
the root's gradients to arrive as they do (a head's first, the embedding's last), and
the float8-gathered weights not to be cast again (docs/guides/float8-and-compile.md,
"What the planner knows")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import annot
from annot.memory.counting import LiveBytes
from tests.distributed import torchrun
from tests.requires import installed
from tests.speed.cases import memory_model

pytestmark = [installed("torchao"), pytest.mark.distributed]

WORKER = Path(__file__).with_name("memory_worker.py")
BATCH, SEQ = 2, 256
RECIPES = ("none", "tensorwise", "rowwise")


def planned(engine: str) -> dict[str, int]:
    with torch.device("meta"):
        model = memory_model()
    out = {}
    for recipe in RECIPES:
        report = annot.estimate_memory(model, gpus=2, batch=BATCH, seq=SEQ, precision="bf16",
                                       float8=None if recipe == "none" else recipe)
        out[recipe] = next(row for row in report.rows if row.key == engine).gpu
    return out


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_planner_prices_float8_as_counted(tmp_path, engine):
    out = tmp_path / "peaks.pt"
    torchrun(WORKER, str(out), engine, str(BATCH), str(SEQ), *RECIPES, nproc=2, timeout=300)
    counted = {recipe: max(peaks) for recipe, peaks in torch.load(out).items()}
    predicted = planned(engine)
    for recipe in RECIPES:
        error = predicted[recipe] / counted[recipe] - 1
        assert abs(error) <= 0.05, f"{engine} {recipe}: planner {error:+.2%} off the counted peak"
    for recipe in RECIPES[1:]:
        planned_change = predicted[recipe] - predicted["none"]
        counted_change = counted[recipe] - counted["none"]
        assert counted_change != 0
        assert abs(planned_change / counted_change - 1) <= 0.05, (
            f"{engine} {recipe}: planner says float8 changes the peak by {planned_change} B, "
            f"the count {counted_change} B")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_traced_float8_linear_holds_what_a_real_one_does(recipe):
    """The planner's trace runs under FakeTensorMode: a float8 linear's forward and
    backward there allocate what they allocate on real tensors, byte for byte."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from annot.float8 import float8_config

    float8_linear = __import__("torchao.float8.float8_linear", fromlist=["Float8Linear"]).Float8Linear

    def peak(mode) -> tuple[int, int]:
        with mode:
            linear = nn.Linear(256, 768, bias=False, dtype=torch.bfloat16)
            module = float8_linear.from_float(linear, config=float8_config(recipe))
            x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
        counter = LiveBytes()
        counter.exclude(module.weight)
        counter.exclude(x)
        with mode, counter:
            y = module(x)
            saved = counter.current
            y.sum().backward()
        return saved, counter.peak

    import contextlib

    assert peak(FakeTensorMode()) == peak(contextlib.nullcontext())


def test_the_planner_times_float8_matmuls_at_the_gpus_float8_rate():
    """Step time: the float8 linears' matmul FLOPs (2 x tokens x in x out forward, twice
    that backward) at the GPU's float8/bf16 peak ratio, 2 on an H100, 1 on an A100 (no
    float8 matmul); everything else as in bf16."""
    with torch.device("meta"):
        model = memory_model()

    def compute(gpu: str, recipe: str | None) -> float:
        report = annot.estimate_memory(model, gpus=2, batch=BATCH, seq=SEQ, precision="bf16", gpu=gpu,
                                       float8=recipe)
        return next(row for row in report.rows if row.key == "fsdp2").time.compute

    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
    float8_flops = 6 * BATCH * SEQ * sum(m.weight.numel() for m in linears)
    rate = annot.memory.communication.TFLOPS * 1e12
    assert compute("H100", None) - compute("H100", "tensorwise") == pytest.approx(float8_flops / rate / 2)
    assert compute("A100", "tensorwise") == pytest.approx(compute("A100", None))
