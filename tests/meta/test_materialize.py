"""meta_init + materialize on one process: the correctness contract of deferred init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import annot
from annot.meta.deferred import deferred_init_of
from examples.gpt.model import GPT

SHAPE = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, block_size=32)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()))


def _assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    different = [n for n in sa if sa[n].dtype != sb[n].dtype or not torch.equal(sa[n], sb[n])]
    assert different == []


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("make", [lambda: GPT(**SHAPE), _llama], ids=["gpt", "llama"])
def test_bitwise_equal_to_eager_construction(make):
    torch.manual_seed(1234)
    with annot.meta_init():
        model = make()
    assert all(t.is_meta for t in _state(model).values())  # nothing allocated
    annot.materialize(model)
    torch.manual_seed(1234)
    _assert_bitwise_equal(model, make())


def test_build_shortcut_and_forward_matches_eager():
    torch.manual_seed(0)
    model = annot.materialize(annot.build(GPT, **SHAPE))
    torch.manual_seed(0)
    eager = GPT(**SHAPE)
    x = torch.randint(0, 97, (2, 16))
    assert torch.equal(model(x, x)[1], eager(x, x)[1])


def test_ties_survive_meta_init_and_materialize():
    with annot.meta_init():
        model = GPT(**SHAPE)
    assert model.lm_head.weight is model.transformer.wte.weight
    annot.materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(set(map(id, model.parameters())))


def test_non_persistent_buffers_are_recomputed():
    with annot.meta_init():
        model = GPT(**SHAPE)
    annot.materialize(model)
    mask = model.transformer.h[0].attn.mask
    assert torch.equal(mask[0, 0], torch.tril(torch.ones(32, 32, dtype=torch.bool)))


def test_rotary_inv_freq_is_recomputed():
    with annot.meta_init():
        model = _llama()
    annot.materialize(model)
    rotary = model.model.rotary_emb
    head_dim = 32 // 4
    expected = 1.0 / (rotary.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert torch.allclose(rotary.inv_freq, expected)


def test_cast_before_materialize_equals_casting_eager():
    torch.manual_seed(0)
    with annot.meta_init():
        model = GPT(**SHAPE)
    model.to(torch.bfloat16)
    annot.materialize(model)
    torch.manual_seed(0)
    _assert_bitwise_equal(model, GPT(**SHAPE).to(torch.bfloat16))


def test_materialize_leaves_the_callers_random_state_alone():
    with annot.meta_init():
        model = GPT(**SHAPE)
    state = torch.get_rng_state()
    annot.materialize(model)
    assert torch.equal(torch.get_rng_state(), state)


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 3))


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(3, 3)
        self.bad = NoInit()


def test_a_module_without_init_path_is_an_error_naming_it():
    with annot.meta_init():
        model = Holder()
    with pytest.raises(annot.DeferredInitError) as info:
        annot.materialize(model)
    message = str(info.value)
    assert "no init path for bad.weight" in message
    assert "module(s) bad (NoInit) create parameters that nothing initializes" in message
    assert "reset_parameters()" in message


def test_a_module_without_init_path_is_named_by_path_and_class():
    """A numbered path (`1.weight` in a Sequential) says nothing of which code to fix:
    the class does (issue #33)."""
    with annot.meta_init():
        model = nn.Sequential(nn.Linear(3, 3), NoInit())
    with pytest.raises(annot.DeferredInitError) as info:
        annot.materialize(model)
    assert "module(s) 1 (NoInit) create parameters" in str(info.value)


def test_a_recorded_buffer_set_to_none_names_its_module_class():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Module()
            self.inner.register_buffer("scale", torch.ones(2))

    with annot.meta_init():
        model = WithBuffer()
    model.inner.scale = None
    with pytest.raises(annot.DeferredInitError, match=r"inner.scale is None now in module inner \(Module\)"):
        annot.materialize(model)


class LazyReset(nn.Module):
    """Defines reset_parameters but its constructor never calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


def test_reset_parameters_is_the_init_path_of_last_resort():
    torch.manual_seed(3)
    with annot.meta_init():
        model = LazyReset()
    annot.materialize(model)
    torch.manual_seed(3)
    eager = LazyReset()
    eager.reset_parameters()
    assert torch.equal(model.weight, eager.weight)


def test_registered_init():
    annot.register_init(NoInit, lambda m: nn.init.constant_(m.weight, 0.5))
    try:
        with annot.meta_init():
            model = Holder()
        annot.materialize(model)
        assert torch.equal(model.bad.weight, torch.full((3, 3), 0.5))
    finally:
        from annot.meta.deferred import _registered_inits

        _registered_inits.pop(NoInit)


def test_materialize_needs_a_record():
    with torch.device("meta"):
        model = GPT(**SHAPE)
    with pytest.raises(annot.DeferredInitError, match="was not built under annot.meta_init"):
        annot.materialize(model)


def test_submodules_built_in_the_block_do_not_get_their_own_record():
    with annot.meta_init():
        model = GPT(**SHAPE)
        extra = nn.Linear(2, 2)
    assert deferred_init_of(model) is not None and deferred_init_of(extra) is not None
    assert deferred_init_of(model.transformer.h[0]) is None
    annot.materialize(extra)
    assert not extra.weight.is_meta


def test_a_module_built_after_its_parent_and_put_in_it_is_not_a_root_of_its_own():
    def make() -> nn.Module:
        parent = nn.Sequential(nn.Linear(3, 3))
        parent.add_module("late", nn.Linear(3, 3))  # built after the Sequential finished
        return parent

    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    with annot.meta_init():
        model = make()
    assert deferred_init_of(model) is not None and deferred_init_of(model.late) is None
    annot.materialize(model)
    for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_meta_init_restores_module_construction():
    with annot.meta_init():
        pass
    layer = nn.Linear(2, 2)
    assert not layer.weight.is_meta and deferred_init_of(layer) is None


@pytest.mark.parametrize("make", [lambda: GPT(n_layer=4, n_embd=128, n_head=4, vocab_size=500, block_size=64),
                                  _llama], ids=["gpt", "llama"])
def test_replay_holds_at_most_about_one_parameter_at_a_time(make):
    from annot.meta.materialization import replay_stats

    with annot.meta_init():
        model = make()
    annot.materialize(model)
    stats = replay_stats(model)
    state = _state(model)
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # Init code that creates every parameter first and initializes them all at the end
    # (GPT's self.apply, transformers' post_init) would hold the whole model if replayed
    # naively; lazy allocation and dead-write elimination keep one tensor alive.
    # Small temporaries (rotary frequencies, constants) may overlap with the largest one.
    assert stats.peak_bytes <= largest + buffers + 1024, (stats.peak_bytes, largest, total)
    assert stats.peak_bytes < total / 4


def test_progress_is_reported_when_asked(capsys):
    with annot.meta_init():
        model = GPT(**SHAPE)
    annot.materialize(model, progress=True)
    assert "materializing: 100%" in capsys.readouterr().err


def test_a_recorded_buffer_set_to_none_is_named():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2))

    with annot.meta_init():
        model = WithBuffer()
    model.scale = None  # was an AttributeError on None inside materialize
    with pytest.raises(annot.DeferredInitError, match="scale is None now"):
        annot.materialize(model)


class _SeededInside(nn.Module):
    """A constructor that reseeds between two layers (found in the wild: per-layer seeds)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        torch.manual_seed(5)
        self.b = nn.Linear(8, 8)


def test_a_seed_set_inside_the_block_is_replayed_where_it_was_set():
    torch.manual_seed(0)
    eager = _SeededInside()
    torch.manual_seed(0)
    with annot.meta_init():
        model = _SeededInside()
        torch.manual_seed(3)  # between two models of one block too
        second = nn.Linear(4, 4)
    torch.manual_seed(3)
    eager_second = nn.Linear(4, 4)
    annot.materialize(model)
    annot.materialize(second)
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(got, want), name
    assert torch.equal(second.weight, eager_second.weight)


def test_allocation_gives_what_to_empty_gives():
    """`materialize` allocates with its own `_to_empty` (faster for DTensors and contiguous
    tensors, issue #42): each tensor as `nn.Module.to_empty` makes it: kind, shape,
    strides, dtype, device, requires_grad; a non-contiguous buffer keeps to_empty's strides."""
    from annot.meta.materialization import _to_empty

    def build() -> nn.Module:
        with torch.device("meta"):
            model = nn.Linear(6, 4)
            model.register_buffer("transposed", torch.empty(3, 5, dtype=torch.float16).t())
            model.register_buffer("scale", torch.empty(2), persistent=False)
            model.bias.requires_grad_(False)
        return model

    def described(model: nn.Module) -> list[tuple]:
        return [(name, type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
                for name, t in _state(model).items()]

    expected, got = build(), build()
    expected.to_empty(device="cpu")
    _to_empty(got, "cpu")
    assert described(got) == described(expected)
