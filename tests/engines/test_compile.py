"""annot's run-time checkpointing under ``torch.compile``: a checkpointed block compiles
with ``fullgraph=True`` and no graph break, computes the eager bare model's numbers, and
really recomputes in backward; eval mode and ``no_grad`` still skip checkpointing.

Compiled with a recording backend: AOTAutograd (the partitioner inductor uses, which
turns a checkpointed region into recomputation in the backward graph) running eager
kernels. Graph breaks are dynamo's and do not depend on the backend; eager kernels keep
the numbers bit-comparable (fp32, tolerance 1e-6) and the test fast on CPU. With
inductor the same block compiled with 0 graph breaks and gradients within 6e-8.
"""

from __future__ import annotations

import copy
import functools
import socket
import warnings

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import annot
from annot.runtime.activation_checkpoint import checkpoint_module, has_outer_checkpoint
from annot.runtime.activation_offload import activation_offloader, offload_activations
from examples.gpt.model import GPT

# Slow lane: torch.compile traces and compiles every test's graphs: seconds each.
pytestmark = pytest.mark.slow

TOL = {"rtol": 0, "atol": 1e-6}  # fp32
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
CHECKPOINT_REGION = torch.ops.higher_order.tag_activation_checkpoint


class Recorder:
    """A torch.compile backend: AOTAutograd with eager kernels that counts, per compiled
    graph, dynamo's checkpoint regions and the matmuls of the forward and backward
    graphs AOTAutograd partitions it into (the backward's include what it recomputes)."""

    def __init__(self) -> None:
        self.checkpoint_regions = 0
        self.matmuls = {"forward": 0, "backward": 0}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.checkpoint_regions += sum(n.target is CHECKPOINT_REGION for n in gm.graph.nodes)
        return aot_autograd(
            fw_compiler=functools.partial(self._compile, "forward"),
            bw_compiler=functools.partial(self._compile, "backward"),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _compile(self, kind: str, gm: torch.fx.GraphModule, _example_inputs):
        self.matmuls[kind] += sum(n.target in MATMULS for n in gm.graph.nodes)
        return make_boxed_func(gm.forward)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def gpt(cls: type[GPT] = GPT, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return cls(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def block(checkpointed: bool = True) -> torch.nn.Module:
    b = gpt().transformer.h[0]
    return checkpoint_module(b) if checkpointed else b


def block_input() -> torch.Tensor:
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)


def compile_blocks(model: GPT, backend) -> None:
    for b in model.transformer.h:
        b.compile(fullgraph=True, backend=backend)


def train_step(model: GPT) -> torch.Tensor:
    idx = tokens()
    _, loss = model(idx, idx)
    loss.backward()
    return loss


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for backward of one call, parameters
    and buffers left out (a compiled region saves through ``ctx.save_for_backward``), and
    so is the generator state a compiled checkpoint stashes to replay a seeded op (the
    example's scaled_dot_product_attention takes a dropout probability): a fixed few KiB
    per region, not an activation."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    kept: dict[int, int] = {}
    generator_state = torch.get_rng_state()

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.dtype == torch.uint8 and tensor.shape == generator_state.shape:
            return tensor
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        module(x)
    return sum(kept.values())


def test_a_checkpointed_block_compiles_with_fullgraph_and_no_graph_break():
    b, recorder = block(), Recorder()
    b.compile(fullgraph=True, backend=recorder)  # raises at the first call on a graph break
    b(block_input()).sum().backward()
    assert graph_breaks() == 0, dict(counters["graph_break"])
    assert recorder.checkpoint_regions == 1


def test_compiled_checkpointed_blocks_give_the_eager_bare_models_loss_and_gradients():
    bare, model = gpt(), gpt()
    for b in model.transformer.h:
        checkpoint_module(b)
    compile_blocks(model, Recorder())
    torch.testing.assert_close(train_step(model), train_step(bare), **TOL)
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    assert graph_breaks() == 0


def test_a_compiled_checkpointed_block_keeps_only_its_input_for_backward():
    checkpointed, plain = block(), block(checkpointed=False)
    for b in (checkpointed, plain):
        b.compile(fullgraph=True, backend=Recorder())
    x = block_input()
    assert saved_activation_bytes(checkpointed, x) == x.nbytes
    assert saved_activation_bytes(plain, x) > 10 * x.nbytes


def test_the_compiled_backward_recomputes_the_blocks_matmuls():
    (checkpointed, plain), recorders = (block(), block(checkpointed=False)), (Recorder(), Recorder())
    for b, recorder in zip((checkpointed, plain), recorders, strict=True):
        torch._dynamo.reset()
        b.compile(fullgraph=True, backend=recorder)
        b(block_input()).sum().backward()
    recorded, bare = recorders
    assert recorded.matmuls["forward"] == bare.matmuls["forward"]
    # Every forward matmul whose output backward needs is run again there.
    recomputed = recorded.matmuls["backward"] - bare.matmuls["backward"]
    assert 0 < recomputed <= recorded.matmuls["forward"], recorded.matmuls


def test_a_compiled_block_in_eval_mode_does_not_checkpoint():
    checkpointed, plain = block().eval(), block(checkpointed=False).eval()
    recorders = Recorder(), Recorder()
    for b, recorder in zip((checkpointed, plain), recorders, strict=True):
        torch._dynamo.reset()
        b.compile(fullgraph=True, backend=recorder)
        b(block_input()).sum().backward()  # autograd on: saved as usual, nothing recomputed
    assert recorders[0].checkpoint_regions == 0
    assert recorders[0].matmuls == recorders[1].matmuls
    assert graph_breaks() == 0


def test_a_compiled_block_under_no_grad_does_not_checkpoint():
    b, recorder = block(), Recorder()
    b.compile(fullgraph=True, backend=recorder)
    with torch.no_grad():
        b(block_input())
    assert recorder.checkpoint_regions == 0
    assert graph_breaks() == 0


def test_switching_to_eval_and_back_recompiles_rather_than_reusing_the_graph():
    b, recorder = block(), Recorder()
    b.compile(fullgraph=True, backend=recorder)
    b(block_input())
    b.eval()(block_input())
    b.train()(block_input()).sum().backward()
    assert recorder.checkpoint_regions == 1  # two graphs: the training one checkpoints
    assert graph_breaks() == 0


class RewrittenGPT(GPT):
    """The example GPT whose block loop checkpoints each block itself."""

    checkpoint_fn = staticmethod(functools.partial(checkpoint, use_reentrant=False))

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for b in self.transformer.h:
            x = self.checkpoint_fn(b, x) if self.training and torch.is_grad_enabled() else b(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_whole_model_compiled_under_its_own_checkpoint_recomputes_once():
    """The model's checkpoint and annot's nest in one graph: the backward recomputes each
    block once, as with the model's checkpoint alone, and the numbers are the bare
    model's."""
    # One block: the whole model is one graph, so its compile time grows with depth.
    bare, own, both = gpt(n_layer=1), gpt(RewrittenGPT, 1), gpt(RewrittenGPT, 1)
    for b in both.transformer.h:
        checkpoint_module(b)
    expected = train_step(bare)
    recorders = Recorder(), Recorder()
    for model, recorder in zip((own, both), recorders, strict=True):
        torch._dynamo.reset()
        model.compile(fullgraph=True, backend=recorder)
        torch.testing.assert_close(train_step(model), expected, **TOL)
    assert recorders[1].matmuls == recorders[0].matmuls
    for (name, p), q in zip(both.named_parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    assert graph_breaks() == 0


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_compiled_block_under_an_eager_outer_checkpoint_keeps_gradients(reentrant):
    """The documented limit: detection is skipped while compiling, so the block is
    checkpointed inside the outer checkpoint (its compiled backward recomputes it once
    more) and annot does not note the outer one; the gradients are unchanged."""
    bare, x_bare = block(checkpointed=False), block_input()
    bare(x_bare).square().sum().backward()
    b, x, recorder = block(), block_input(), Recorder()
    b.compile(fullgraph=True, backend=recorder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint(b, x, use_reentrant=reentrant).square().sum().backward()
    for got, want in zip(_grads(b, x), _grads(bare, x_bare), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert recorder.checkpoint_regions == 1
    assert not has_outer_checkpoint(b)
    assert not [w for w in caught if "annot" in str(w.message)]
    assert graph_breaks() == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def gloo_one_rank(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_auto_wrap_with_checkpointing_then_per_block_compile(gloo_one_rank):
    """The issue's scenario, as torchtitan does it: shard and checkpoint with annot, then
    compile each block with fullgraph=True. FSDP2's hooks run outside the compiled
    forward (dynamo starts at the block's forward), so nothing breaks the graph."""

    def losses(model: GPT) -> list[float]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for _ in range(2):
            out.append(train_step(model).item())
            optimizer.step()
            optimizer.zero_grad()
        return out

    expected = losses(gpt())
    model, recorder = annot.auto_wrap(gpt(), "fsdp2", checkpoint=True), Recorder()
    compile_blocks(model, recorder)
    assert losses(model) == pytest.approx(expected, rel=0, abs=1e-6)
    assert graph_breaks() == 0, dict(counters["graph_break"])
    assert recorder.checkpoint_regions >= 1  # torch 2.13: 1, both blocks share one graph


@pytest.mark.parametrize("checkpointed", [False, True], ids=["offload", "checkpoint+offload"])
def test_an_offloaded_block_compiles_with_fullgraph_and_offloads_what_it_saves(checkpointed):
    """The offload hooks run eagerly around the compiled forward, so what the compiled
    region saves for backward goes to the host and comes back, and numbers hold."""
    bare, x_bare = block(checkpointed=False), block_input()
    bare(x_bare).square().sum().backward()
    b, x = block(checkpointed), block_input()
    offloader = offload_activations(b)
    b.compile(fullgraph=True, backend=Recorder())
    b(x).square().sum().backward()
    assert graph_breaks() == 0
    for got, want in zip(_grads(b, x), _grads(bare, x_bare), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert offloader.packed_tensors == offloader.unpacked_tensors > 0
    # Checkpointed, the compiled region keeps its input and the generator state it
    # replays attention's (seeded) kernel with; unchecked, ~30x its input.
    kept_at_most = 2 * x.nbytes + torch.get_rng_state().nbytes
    assert (offloader.packed_bytes < kept_at_most) == checkpointed, offloader.packed_bytes


def test_offload_hooks_kept_out_of_compile_still_follow_a_deep_copy():
    b = block()
    offloader = offload_activations(b)
    clone = copy.deepcopy(b)
    clone(block_input())
    assert activation_offloader(clone) is not offloader
    assert activation_offloader(clone).packed_tensors > 0 and offloader.packed_tensors == 0
