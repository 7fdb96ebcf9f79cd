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


def test_a_cast_made_under_no_grad_is_not_reused_with_gradients():
    # As torch's autocast (checked on the CPU's here): a weight first used under no_grad
    # still gets its gradient from a later call with gradients (HRM's cycles). A matmul,
    # not F.linear: DeepSpeed's ZeRO-3 replaces F.linear for the rest of a process that
    # ran it (pitfall 48's neighbour; the trace puts torch's back, this test would not).
    def weight_gets_a_gradient(region) -> bool:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(4, 4))
        x = torch.randn(2, 4, requires_grad=True)
        with region():
            with torch.no_grad():
                x @ weight
            y = x @ weight
        y.float().sum().backward()
        return weight.grad is not None

    assert weight_gets_a_gradient(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert weight_gets_a_gradient(lambda: CudaAutocast(torch.bfloat16))


def test_a_checkpointed_block_run_under_no_grad_before_is_traced_under_the_gpu_rules():
    import annot

    @annot.shard_block
    @annot.checkpoint_block
    class Block(nn.Sequential):
        pass

    class Cycles(nn.Module):
        """Two no_grad cycles of a block, then one with gradients (HRM's shape)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block = nn.Embedding(11, 8), Block(nn.Linear(8, 8), nn.GELU())

        def forward(self, input_ids=None):
            h = self.embed(input_ids)
            with torch.no_grad():
                for _ in range(2):
                    h = self.block(h)
            return self.block(h).float().sum()

    model = Cycles()
    plan = annot.plan(model)
    assert plan.paths("checkpoint") == ["block"]
    trace = trace_step(model, plan, batch=1, seq=4, checkpoint=True, autocast=torch.bfloat16, gpu_rules=True)
    # The block's weights get gradients (the embedding's output went through no_grad).
    assert trace.grads == sum(p.numel() * 4 for p in model.block.parameters())
