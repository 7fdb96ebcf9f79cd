"""Expert parallelism's plan and its refusals, in one process (training on 2 and 4 ranks
is in test_moe.py, loading and saving in test_moe_load.py).

`resolve_expert_plan` reads the model's own ``ep_plan``; everything it cannot split is
refused before the model changes, with the reason. The FSDP2 checks run on torch's fake
process group (4 ranks in this process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import annot
from annot.huggingface.expert_parallel import resolve_expert_plan
from tests.huggingface.moe_training_models import MOE_MODELS

transformers = pytest.importorskip("transformers")


def _meta(name: str, **changes) -> torch.nn.Module:
    config_class, model_class, options = MOE_MODELS[name]
    config = getattr(transformers, config_class)(**{**options, **changes})
    with annot.meta_init():
        return getattr(transformers, model_class)(config)


@pytest.fixture
def world4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_plan_names_every_experts_module_and_its_stacks(name):
    model = _meta(name)
    plan = resolve_expert_plan(model, 2)
    moe_layers = [b.path for b in annot.plan(model).moe]
    assert list(plan.experts) == [f"{path}.experts" for path in moe_layers]
    assert set(plan.experts.values()) == {4}
    for path in plan.experts:  # every stacked parameter of each experts module is split
        stacks = {f"{path}.{n}" for n, p in model.get_submodule(path).named_parameters() if p.ndim >= 2}
        assert stacks and stacks <= set(plan.stacks), path
    styles = plan.styles()
    assert list(styles)[:len(plan.stacks)] == list(plan.stacks)  # stacks before their module


def test_an_expert_count_that_ep_does_not_divide_is_refused():
    model = _meta("qwen3_moe", num_experts=6)
    resolve_expert_plan(model, 2)  # 6 split over 2: fine
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts has 6 experts.*divides"):
        resolve_expert_plan(model, 4)


def test_a_model_without_an_ep_plan_is_refused():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    with annot.meta_init():
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no ep_plan"):
        resolve_expert_plan(model, 2)


def test_a_style_annot_does_not_apply_is_refused():
    model = _meta("mixtral")
    model.ep_plan = {**model.ep_plan, "model.layers.*.mlp.gate": "colwise"}
    with pytest.raises(ValueError, match="uses 'colwise'; annot applies only"):
        resolve_expert_plan(model, 2)


def test_a_peft_model_is_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_meta("mixtral"), peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="on a PEFT model is not available"):
        resolve_expert_plan(model, 2)


@pytest.mark.parametrize(("dims", "match"), [
    (dict(tp=2, ep=2), "expert parallelism beside tensor or context parallelism"),
    (dict(replicate=2, ep=4), "ep=4 must divide shard=2"),
])
def test_fsdp2_refuses_layouts_it_cannot_split_before_the_model_changes(world4, dims, match):
    model = _meta("qwen3_moe")
    with pytest.raises(ValueError, match=match):
        annot.auto_wrap(model, "fsdp2", mesh=annot.ParallelDims(**dims))
    assert not any(hasattr(p, "device_mesh") for p in model.parameters())
    assert all(m.num_experts == 4 for n, m in model.named_modules() if n.endswith(".experts"))
