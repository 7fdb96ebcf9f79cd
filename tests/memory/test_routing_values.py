"""Memory traces of models that read values (issue #29): `annot.memory.routing_values`.

The reference for the model cases is independent of the trace: a real CPU training step
(forward, loss, backward) of the same model, its live tensor bytes counted by
`LiveBytes` on real tensors, with its routers' top-k replaced by the stated balanced
assignment (this file's `_BalancedTopk`, not the planner's code). Measured equal to the
byte at (batch 1, seq 16) and (2, 48) (2026-11-26); the test runs the second; the bound
is 0.1%.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from annot.huggingface.model import cache_off_in_training
from annot.memory.activations import _torch_linear, default_inputs, trace_step
from annot.memory.counting import LiveBytes
from annot.memory.inputs import default_loss
from annot.memory.report import MOE_COUNTED
from annot.memory.routing_values import INPUT_ASSUMPTION, ROUTING_ASSUMPTION, ValueShadows

TOLERANCE = 1e-3


def test_a_top_k_over_unknown_scores_routes_every_expert_the_same_number_of_tokens():
    with FakeTensorMode() as fake:
        scores = torch.empty(12, 4)  # made before the shadows, as the weights: no value to know
    with fake, ValueShadows() as shadows:
        chosen = scores.topk(2, dim=-1).indices
        counts = torch.bincount(chosen.flatten(), minlength=4).tolist()
        first = chosen[0].tolist()
    assert counts == [6, 6, 6, 6]
    assert first == [0, 1]  # token 0's choices: two different experts
    assert shadows.assumption == ROUTING_ASSUMPTION


def test_a_nonzero_over_routing_gets_its_real_size():
    with FakeTensorMode() as fake:
        scores = torch.empty(8, 4)
    with fake, ValueShadows():
        chosen = scores.topk(1, dim=-1).indices  # tokens 0..7 -> experts 0,1,2,3,0,...
        tokens = torch.where(chosen.squeeze(-1) == 2)[0]
    assert tokens.shape == (2,)


def test_a_value_of_the_inputs_is_read_from_them():
    with FakeTensorMode(), ValueShadows() as shadows:
        ids = torch.full((2, 5), 7, dtype=torch.long)
        lengths = (ids != 0).sum(dim=1)
        longest = lengths.max().item()
    assert longest == 5
    assert shadows.assumption == INPUT_ASSUMPTION


def test_a_value_that_depends_on_the_weights_is_still_refused():
    with FakeTensorMode() as fake:
        weight = torch.empty(4, 4)
    with fake, ValueShadows():
        with pytest.raises(DataDependentOutputException):
            (weight.sum() > 0).item()


def test_an_in_place_write_of_unknown_values_forgets_the_shadow_and_its_views():
    with FakeTensorMode() as fake:
        weight = torch.empty(4)
    with fake, ValueShadows():
        ids = torch.zeros(4, dtype=torch.long)
        head = ids[:2]
        assert head.sum().item() == 0
        ids.copy_(weight.long())  # values from no shadow
        with pytest.raises(DataDependentOutputException):
            head.sum().item()
        with pytest.raises(DataDependentOutputException):
            ids.max().item()


def test_an_in_place_write_of_known_values_keeps_the_shadow():
    with FakeTensorMode(), ValueShadows():
        ids = torch.zeros(4, dtype=torch.long)
        ids.add_(torch.arange(4))
        assert ids.tolist() == [0, 1, 2, 3]


class _BalancedTopk(TorchDispatchMode):
    """A real step's top-k indices replaced by the balanced assignment: row r's j-th
    choice among n is (r*k + j) mod n."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            values, indices = out
            k, n = indices.shape[-1], args[0].shape[-1]
            out = (values, (torch.arange(indices.numel()).reshape(-1, k) % n).reshape(indices.shape))
        return out


def _tiny(model_type: str):
    transformers = pytest.importorskip("transformers")
    from tests.huggingface.sweep_configs import tiny_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))


def _real_peak(model, batch: int, seq: int) -> int:
    counter = LiveBytes()
    for kept in (*model.parameters(), *model.buffers()):
        counter.exclude(kept)
    model.train()
    # torch's F.linear, as the trace runs it (a ZeRO-3 run earlier in the process replaces it).
    with _torch_linear(), counter, _BalancedTopk(), cache_off_in_training(model):
        args, kwargs = default_inputs(model, batch, seq)
        loss = default_loss(model(*args, **kwargs))
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return counter.peak


# JetMoE splits tokens by expert counts (.tolist()); LongCat-Flash loops over the experts
# hit (nonzero, .item()) and has zero-compute experts; XLM asserts lengths.max().item().
@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "assumption"), [
    ("jetmoe", ROUTING_ASSUMPTION), ("longcat_flash", ROUTING_ASSUMPTION), ("xlm", INPUT_ASSUMPTION)])
def test_a_model_that_reads_values_is_traced_as_its_real_step_counts(model_type, assumption):
    model = _tiny(model_type)
    batch, seq = 2, 48  # equal to the byte at (1, 16) too, measured
    trace = trace_step(model, None, batch=batch, seq=seq, checkpoint=False)
    real = _real_peak(model, batch, seq)
    assert abs(trace.peak_with_grads - real) <= TOLERANCE * real, (model_type, trace, real)
    assert trace.assumption == assumption


def test_a_model_that_reads_no_value_is_traced_without_an_assumption():
    trace = trace_step(_tiny("mixtral"), None, batch=1, seq=16, checkpoint=False)
    assert trace.assumption == ""


def test_the_trace_s_token_ids_avoid_every_special_token():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=[2, 3])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    _, kwargs = default_inputs(model, 2, 3)
    assert kwargs["input_ids"].unique().tolist() == [4]


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "note"), [("jetmoe", ROUTING_ASSUMPTION), ("mixtral", MOE_COUNTED)])
def test_the_memory_table_says_what_routing_it_assumed(model_type, note):
    from annot.memory import estimate_memory

    report = estimate_memory(_tiny(model_type), gpus=1, batch=1, seq=16)
    assert report.assumptions == (note,)
    assert report.table().splitlines()[-1] == f"note: {note}"


@pytest.mark.sweep
def test_longcat_flash_s_expert_count_traces_at_the_default_sequence():
    # 512 routed experts, 256 identities, top-12 at 2,048 tokens: the expert mask the
    # per-expert loop reads has 19M elements (SHADOW_LIMIT must hold it). About a minute.
    import annot

    transformers = pytest.importorskip("transformers")
    from tests.huggingface.sweep_configs import tiny_config

    config = tiny_config("longcat_flash")
    config.n_routed_experts, config.zero_expert_num, config.num_experts_per_tok = 512, 256, 12
    with annot.meta_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    trace = trace_step(model, None, batch=1, seq=2048, checkpoint=False)
    assert trace.assumption == ROUTING_ASSUMPTION and trace.peak > 0


def test_a_fake_tensors_memory_read_outside_any_operation_reads_values():
    # UDOP turns a tensor into indices with zip(*ind): C++ reads the fake tensor's memory.
    from annot.memory.routing_values import reads_values

    with FakeTensorMode():
        ind = torch.zeros(3, 2, dtype=torch.long)
        target = torch.ones(4, 4, dtype=torch.bool)
        rows, cols = zip(*ind, strict=True)
        with pytest.raises(RuntimeError) as caught:
            target[rows, cols] = False
    assert reads_values(caught.value)
    assert not reads_values(RuntimeError("shape mismatch"))
