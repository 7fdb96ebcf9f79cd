"""Compiled blocks (`annot.compiled_blocks`): a unit's forward compiled in place, whole
where dynamo can trace it, else with graph breaks, else eager, each fallback logged with
its reason; names and numbers unchanged. Backend ``aot_eager`` (forward and backward
traced, torch's own kernels): fp32 numbers bit-comparable to eager, tolerance 1e-6."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch import nn

from annot.compiled_blocks import (
    CompileOptions,
    compile_report,
    compile_units,
    describe,
    is_compiled,
)
from annot.runtime.activation_checkpoint import apply_checkpointing
from examples.gpt.model import GPT

pytestmark = pytest.mark.slow  # each test compiles graphs: seconds

TOL = {"rtol": 0, "atol": 1e-6}
BLOCKS = ["transformer.h.0", "transformer.h.1"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def loss_and_grads(model: GPT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_blocks_compile_whole_with_eagers_numbers_and_names():
    eager = gpt()
    apply_checkpointing(eager, BLOCKS)
    compiled = gpt()
    apply_checkpointing(compiled, BLOCKS)
    keys = list(compiled.state_dict())
    compile_units(compiled, BLOCKS, CompileOptions(backend="aot_eager"))
    assert list(compiled.state_dict()) == keys
    loss, grads = loss_and_grads(compiled)
    ref_loss, ref_grads = loss_and_grads(eager)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL)
    report = compile_report(compiled)
    assert [(c.path, c.status, c.graph_breaks) for c in report] == [
        ("transformer.h.0", "fullgraph", 0), ("transformer.h.1", "fullgraph", 0)]
    assert describe(report) == "compile: 2 fullgraph; 0 graph breaks"
    with pytest.raises(ValueError, match="compiled already"):
        compile_units(compiled, BLOCKS[:1], CompileOptions(backend="aot_eager"))


class Breaking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()  # what an untraceable call in a block does
        return x.relu()


def test_a_block_that_breaks_the_graph_falls_back_with_the_reason_logged(caplog):
    model = nn.Sequential(Breaking())
    x = torch.randn(4, 8)
    expected = model(x)
    compile_units(model, ["0"], CompileOptions(backend="aot_eager"))
    with caplog.at_level(logging.WARNING, logger="annot"):
        out = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    (compiled,) = compile_report(model)
    assert compiled.status == "graph breaks" and compiled.graph_breaks >= 1
    assert "does not compile whole" in caplog.text and "compiled with graph breaks" in caplog.text
    assert compiled.reason.startswith("Unsupported")
    torch.testing.assert_close(model(x), expected, **TOL)  # and stays so


def test_a_block_no_backend_compiles_runs_eager_and_says_so(caplog):
    def failing(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    expected = model(x)
    compile_units(model, ["0"], CompileOptions(backend=failing))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="annot"):
        out = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    (compiled,) = compile_report(model)
    assert compiled.status == "eager"
    assert "runs eager" in caplog.text and "this backend cannot compile anything" in compiled.reason
    assert is_compiled(model[0])


def test_a_frame_dynamo_skips_is_reported_eager_not_compiled(caplog):
    """A counting dispatch mode (the planner's `LiveBytes`) keeps dynamo from tracing at
    all: the block runs eager, and says so, rather than report a compile that never was."""
    from annot.memory.counting import LiveBytes

    model = nn.Sequential(nn.Linear(8, 8))
    compile_units(model, ["0"], CompileOptions(backend="aot_eager"))
    with caplog.at_level(logging.WARNING, logger="annot"), LiveBytes():
        model(torch.randn(4, 8))
    (compiled,) = compile_report(model)
    assert compiled.status == "eager" and "dispatch mode" in compiled.reason


def test_compile_option_values():
    assert CompileOptions.of(None) is None and CompileOptions.of(False) is None
    assert CompileOptions.of(True) == CompileOptions()
    assert CompileOptions.of("aot_eager").backend == "aot_eager"
    with pytest.raises(TypeError, match="compile= takes True"):
        CompileOptions.of(3)  # type: ignore[arg-type]
