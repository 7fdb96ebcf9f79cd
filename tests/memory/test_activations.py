"""Traced activation estimates against the bytes a real CPU run saves for backward.

The reference here is computed independently of the estimator: a real forward on the
CPU with saved-tensor hooks, and for checkpointing a real ``torch.utils.checkpoint``
around each checkpointed unit (what it keeps: its inputs, and whatever is saved outside
it). The estimator traces fake tensors once and derives both figures from that trace.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree
from torch.utils.checkpoint import checkpoint

import annot
from annot.memory import trace_activations
from annot.memory.activations import default_inputs
from annot.memory.inputs import step_inputs

TOLERANCE = 0.05  # the bound; most cases agree exactly


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def real_saved_bytes(model: nn.Module, batch: int, seq: int, checkpointed: list[str]) -> int:
    params = {_key(p) for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        if _key(t) not in params:
            kept[_key(t)] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    originals = {}
    for path in checkpointed:
        module = model.get_submodule(path)
        originals[path] = module.forward

        def forward(*args, _inner=module.forward, **kwargs):
            for leaf in _pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    keep(leaf)  # a checkpoint holds its inputs until backward
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
    try:
        model.train()
        args, kwargs, _ = step_inputs(None, model, batch, seq)  # what the trace feeds the model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args, **kwargs)
    finally:
        for path, forward in originals.items():
            model.get_submodule(path).forward = forward
    return sum(kept.values())


def _gpt():
    from examples.gpt.model import GPT

    return GPT(n_layer=3, n_embd=48, n_head=4, vocab_size=97, block_size=64)


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2))
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64))
    if name == "mixtral":  # fused experts: transformers' grouped matmul, top-2 of 4
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**small, max_position_embeddings=64))
    raise AssertionError(name)


MODELS = {"gpt": _gpt, "llama": lambda: _hf("llama"), "gpt2": lambda: _hf("gpt2"), "bert": lambda: _hf("bert"),
          "mixtral": lambda: _hf("mixtral")}


def _within(estimate: int, actual: int) -> bool:
    return abs(estimate - actual) <= TOLERANCE * actual


@pytest.mark.parametrize("name", list(MODELS))
def test_estimates_match_real_saved_bytes(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = annot.plan(model)
    checkpointed = plan.paths("checkpoint")
    assert checkpointed, "the default plan should checkpoint the blocks"
    with torch.device("meta"):
        torch.manual_seed(0)
        meta_model = MODELS[name]()
    for batch in (1, 2, 4):
        estimate = trace_activations(meta_model, plan, batch=batch, seq=32)
        plain = real_saved_bytes(model, batch, 32, [])
        with_ckpt = real_saved_bytes(model, batch, 32, checkpointed)
        assert _within(estimate.saved, plain), (name, batch, estimate.saved, plain)
        assert _within(estimate.saved_checkpointed, with_ckpt), (name, batch, estimate.saved_checkpointed, with_ckpt)
        assert estimate.saved_checkpointed < estimate.saved
        assert estimate.recompute_peak == max(estimate.per_unit.values()) > 0


def test_trace_allocates_nothing_and_leaves_the_model_as_it_was(gpt_meta):
    gpt_meta.eval()
    estimate = trace_activations(gpt_meta, annot.plan(gpt_meta), batch=2, seq=16)
    assert estimate.saved > 0
    assert all(p.is_meta for p in gpt_meta.parameters())
    assert not gpt_meta.training and not any(m.training for m in gpt_meta.modules())
    assert not gpt_meta.transformer.h[0]._forward_pre_hooks


def test_activations_scale_with_batch(gpt_meta):
    plan = annot.plan(gpt_meta)
    one = trace_activations(gpt_meta, plan, batch=1, seq=16)
    four = trace_activations(gpt_meta, plan, batch=4, seq=16)
    assert four.saved == pytest.approx(4 * one.saved, rel=0.01)


def test_compute_dtype_halves_floating_activations(gpt_meta):
    plan = annot.plan(gpt_meta)
    fp32 = trace_activations(gpt_meta, plan, batch=2, seq=16)
    bf16 = trace_activations(gpt_meta, plan, batch=2, seq=16, dtype=torch.bfloat16)
    assert bf16.saved < 0.6 * fp32.saved


def test_bad_batch_is_rejected(gpt_meta):
    with pytest.raises(ValueError, match="at least 1"):
        trace_activations(gpt_meta, None, batch=0, seq=16)


def _tiny_gemma2_on_meta():
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128)
    with torch.device("meta"):
        return transformers.Gemma2ForCausalLM(config)


@pytest.mark.slow
def test_a_checkpointed_transformers_step_is_traced_without_a_kv_cache():
    # Gemma 2's config has use_cache=True: traced as called, recomputing a checkpointed
    # layer appends to the cache a second time and the mask no longer broadcasts. The
    # trace runs the forward as auto_wrap prepares it (use_cache=False; pitfall 14).
    from annot.memory.activations import trace_step

    model = _tiny_gemma2_on_meta()
    assert model.config.use_cache is True
    layer = type(model.model.layers[0])
    plan = annot.plan(model, annot.Policy(shard=annot.by_class(layer), checkpoint=annot.by_class(layer)))
    plain = trace_step(model, plan, batch=1, seq=64, checkpoint=False)
    checkpointed = trace_step(model, plan, batch=1, seq=64, checkpoint=True)
    assert checkpointed.checkpoint and 0 < checkpointed.peak < plain.peak
    assert model.config.use_cache is True  # the user's config is untouched


@pytest.mark.slow
def test_a_plain_transformers_step_is_traced_without_a_kv_cache_too():
    # No training step keeps a key/value cache, checkpointed or not, so no trace does
    # (the plain trace ran with the config's use_cache=True).
    from annot.memory.activations import trace_step

    model = _tiny_gemma2_on_meta()
    seen = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs.get("use_cache")),
                                    with_kwargs=True)
    layer = type(model.model.layers[0])
    plan = annot.plan(model, annot.Policy(shard=annot.by_class(layer)))
    trace_step(model, plan, batch=1, seq=16, checkpoint=False)
    assert seen == [False]


def test_the_cache_is_turned_off_only_where_the_forward_takes_it():
    from annot.huggingface.model import cache_off_in_training, training_forward_kwargs

    model = _tiny_gemma2_on_meta()
    seen = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs.get("use_cache")),
                                    with_kwargs=True)
    with cache_off_in_training(model):
        args, kwargs = (), {"input_ids": 1}
        for hook in model._forward_pre_hooks.values():  # as a forward runs them, in order
            result = hook(model, args, kwargs)
            if result is not None:
                args, kwargs = result
    assert seen == [False]
    assert len(model._forward_pre_hooks) == 1  # taken off again
    with cache_off_in_training(nn.Linear(2, 2)):
        pass  # no transformers model inside: nothing to switch
    with pytest.warns(DeprecationWarning, match="cache_off_in_training"):
        assert training_forward_kwargs(model, (), {"input_ids": 1}) == {"input_ids": 1, "use_cache": False}


def test_a_trace_turns_the_cache_off_inside_a_peft_model():
    # PEFT's PeftModel takes **kwargs, so use_cache=False given to the wrapper was not
    # passed on: the checkpointed trace ran with the cache on, recomputation doubled it,
    # and a LoRA Llama's checkpointed step was priced 8% (15% with an NF4 base) above the
    # count on 2 FSDP2 ranks.
    peft = pytest.importorskip("peft")
    from annot.memory.activations import trace_step

    model = peft.get_peft_model(_tiny_gemma2_on_meta(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    inner = model.base_model.model
    seen = []
    inner.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs.get("use_cache")),
                                    with_kwargs=True)
    layer = type(inner.model.layers[0])
    plan = annot.plan(model, annot.Policy(shard=annot.by_class(layer), checkpoint=annot.by_class(layer)))
    trace_step(model, plan, batch=1, seq=16, checkpoint=True)
    assert seen == [False]


def test_a_model_taking_text_and_optional_images_is_traced_on_text():
    # Fuyu's forward takes input_ids and pixel_values (images optional): it was traced
    # as an image-only model and failed (issue #29).
    from annot.memory.activations import default_inputs

    class TextAndImages(torch.nn.Module):
        config = type("Config", (), {"image_size": 8, "num_channels": 3})()

        def forward(self, input_ids=None, pixel_values=None, labels=None):
            raise AssertionError("not called")

    args, kwargs = default_inputs(TextAndImages(), batch=2, seq=5)
    assert args == () and set(kwargs) == {"input_ids", "labels"}
    assert kwargs["input_ids"].shape == (2, 5)


class _CacheFails(torch.nn.Module):
    """Fails, as Bamba, Dory and xLSTM do in transformers 5.24, when asked for a cache."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)

    def forward(self, input_ids=None, labels=None, use_cache=True):
        if use_cache:
            raise ValueError("`get_seq_length` can only be called on Attention layers")
        return self.embed(input_ids).square().mean()


def test_the_trace_runs_without_a_cache_as_training_does():
    args, kwargs = default_inputs(_CacheFails(), batch=2, seq=5)
    assert kwargs["use_cache"] is False
    estimate = trace_activations(_CacheFails(), None, batch=2, seq=5)
    assert estimate.saved > 0


def test_a_forward_that_reads_a_value_of_its_weights_is_refused_with_the_reason(tmp_path, capsys):
    from annot.cli.main import main

    source = tmp_path / "reads.py"
    # Reads a value the weights decide: no trace without data can know it.
    source.write_text(
        "from torch import nn\nimport annot\n\n"
        "@annot.shard_block\nclass Block(nn.Linear):\n    pass\n\n"
        "class ReadsAValue(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.block = nn.Embedding(11, 8), Block(8, 8)\n\n"
        "    def forward(self, input_ids=None):\n"
        "        h = self.embed(input_ids)\n"
        "        assert h.abs().max().item() < 1e6\n"
        "        return self.block(h).sum()\n")
    assert main(["plan", f"{source}:ReadsAValue", "--memory", "--seq", "8"]) == 2
    err = capsys.readouterr().err
    assert "ReadsAValue.forward reads a tensor's value" in err
    assert "annot plan without --memory works" in err


def test_a_forward_that_splits_tokens_by_expert_counts_is_planned_under_balanced_routing(tmp_path, capsys):
    from annot.cli.main import main

    source = tmp_path / "routes.py"
    # Routes each token to its top-2 of 4 experts and splits the tokens by the counts
    # (.tolist()), as JetMoE does.
    source.write_text(
        "import torch\nfrom torch import nn\nimport annot\n\n"
        "@annot.shard_block\nclass Experts(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.router, self.experts = nn.Linear(8, 4), nn.ModuleList(nn.Linear(8, 8) for _ in range(4))\n\n"
        "    def forward(self, h):\n"
        "        flat = h.reshape(-1, 8)\n"
        "        chosen = self.router(flat).topk(2, dim=-1).indices.flatten()\n"
        "        order = chosen.argsort()\n"
        "        counts = torch.bincount(chosen, minlength=4).tolist()\n"
        "        parts = flat[order // 2].split(counts)\n"
        "        return torch.cat([e(p) for e, p in zip(self.experts, parts)]).sum()\n\n"
        "class Routes(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.moe = nn.Embedding(11, 8), Experts()\n\n"
        "    def forward(self, input_ids=None):\n"
        "        return self.moe(self.embed(input_ids))\n")
    assert main(["plan", f"{source}:Routes", "--memory", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "note: traced under balanced routing" in out


class _StoresItsState(torch.nn.Module):
    """Keeps a tensor on itself in forward, as RecurrentGemma's recurrent block does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.recurrent_states = None

    def forward(self, input_ids=None):
        self.recurrent_states = self.embed(input_ids) + 1.0
        return self.recurrent_states.square().mean()


def test_a_trace_leaves_no_tensor_on_the_model():
    import copy

    model = _StoresItsState()
    trace_activations(model, None, batch=1, seq=4)
    assert model.recurrent_states is None
    copy.deepcopy(model)  # the next trace copies the model: it failed on the fake tensor


class _Vocabulary:
    """A plain helper object that caches a tensor on first use, as Emu3's image
    vocabulary mapping does (``functools.cached_property``)."""

    @functools.cached_property
    def lookup(self) -> torch.Tensor:
        return torch.arange(11) % 7


class _CachesOnAHelper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.vocabulary = _Vocabulary()

    def forward(self, input_ids=None):
        return self.embed(self.vocabulary.lookup[input_ids]).square().mean()


def test_a_trace_leaves_no_tensor_cached_on_a_helper_object():
    model = _CachesOnAHelper()
    first = trace_activations(model, None, batch=1, seq=4)
    assert "lookup" not in vars(model.vocabulary)
    # the second trace met the first one's fake tensor: "Mixing fake modes"
    assert trace_activations(model, None, batch=1, seq=4) == first


class _Rotary:
    """A callable plain object that caches a list of tables on its first call, as
    ZImage's and Bria-Fibo-2's rotary embedders do (not modules: the model calls them)."""

    def __init__(self) -> None:
        self.tables = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tables is None:
            self.tables = [torch.arange(11.0), torch.ones(11)]
        return self.tables[0][ids] * self.tables[1][ids]


class _CachesAListOnACallable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.rotary = _Rotary()

    def forward(self, input_ids=None):
        return (self.embed(input_ids) * self.rotary(input_ids)[..., None]).square().mean()


def test_a_trace_leaves_no_list_of_tensors_cached_on_a_callable_helper():
    model = _CachesAListOnACallable()
    first = trace_activations(model, None, batch=1, seq=4)
    assert model.rotary.tables is None
    assert trace_activations(model, None, batch=1, seq=4) == first  # "Mixing fake modes" before
