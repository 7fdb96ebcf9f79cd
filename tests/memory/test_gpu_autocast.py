"""`CudaAutocast`: a CPU trace casts as CUDA autocast does (softmax, exp, norms and losses
in float32; matmuls in the 16-bit dtype, a parameter's cast made once)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from annot.memory.activations import trace_step
from annot.memory.gpu_autocast import CudaAutocast


def test_softmax_runs_in_fp32_and_linear_in_bf16():
    weight = nn.Parameter(torch.randn(4, 4))
    with CudaAutocast(torch.bfloat16):
        h = F.linear(torch.randn(2, 4), weight)
        again = F.linear(torch.randn(2, 4), weight)
        p = torch.softmax(h, -1)
    assert h.dtype == again.dtype == torch.bfloat16 and p.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's rules keep it 16-bit
        assert torch.softmax(F.linear(torch.randn(2, 4), weight), -1).dtype == torch.bfloat16


class _Scores(nn.Module):
    """A projection, then softmax and exp (as eager attention and some losses do)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.softmax(self.proj(x), -1)).sum()


def test_the_gpu_rules_save_softmax_and_exp_in_fp32():
    with torch.device("meta"):
        model = _Scores()

    def inputs(model, batch, seq):
        return (torch.zeros(batch, seq, 64),), {}

    common = dict(batch=2, seq=8, checkpoint=False, autocast=torch.bfloat16, inputs=inputs)
    cpu = trace_step(model, None, **common)
    gpu = trace_step(model, None, **common, gpu_rules=True)
    # Kept at the end of forward: softmax's and exp's outputs (2 x 8 x 64 elements each)
    # in 4 bytes instead of 2, and the summed scalar too.
    saved_cpu, saved_gpu = cpu.segments[0][3], gpu.segments[0][3]
    assert saved_gpu - saved_cpu == 2 * (2 * 8 * 64) * 2 + 2


def test_a_trace_after_deepspeeds_linear_patch_counts_as_with_torchs(monkeypatch):
    # deepspeed.zero.Init (annot's ZeRO-3 materialization) replaces F.linear for the rest
    # of the process; a plan made afterwards failed under the GPU rules.
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    with torch.device("meta"):
        model = _Scores()

    def inputs(model, batch, seq):
        return (torch.zeros(batch, seq, 64),), {}

    common = dict(batch=2, seq=8, checkpoint=False, autocast=torch.bfloat16, inputs=inputs,
                  gpu_rules=True)
    plain = trace_step(model, None, **common)
    monkeypatch.setattr(F, "linear", zero3_linear_wrap)
    patched = trace_step(model, None, **common)
    assert F.linear is zero3_linear_wrap  # put back after the trace
    assert (patched.peak, patched.segments) == (plain.peak, plain.segments)
