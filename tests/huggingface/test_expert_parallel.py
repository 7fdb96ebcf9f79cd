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


def _own(**changes) -> torch.nn.Module:
    from tests.huggingface.moe_training_models import OWN_MOE, build

    with annot.meta_init():
        return build(OWN_MOE)


def test_a_model_of_ones_own_is_split_where_annots_rule_finds_experts():
    # Not a transformers model: no ep_plan; its experts are found by shape (3-D stacks).
    plan = resolve_expert_plan(_own(), 2)
    assert plan.experts == {"h.0.moe.experts": 4, "h.1.moe.experts": 4}
    assert set(plan.stacks) == {f"h.{i}.moe.experts.{n}" for i in (0, 1) for n in ("gate_up_proj", "down_proj")}


def test_a_model_of_ones_own_may_name_its_experts_with_an_ep_plan():
    model = _own()
    model.ep_plan = {"h.0.moe.experts": "ep_dispatch_experts", "h.0.moe.experts.*": "grouped_gemm"}
    plan = resolve_expert_plan(model, 2)
    assert plan.experts == {"h.0.moe.experts": 4}
    assert set(plan.stacks) == {"h.0.moe.experts.gate_up_proj", "h.0.moe.experts.down_proj"}


class _CountSplitExperts(torch.nn.Module):
    """Stacked experts called with per-expert token counts (torchtitan's GroupedExperts
    takes ``(x, num_tokens_per_expert)``): not transformers' contract."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.zeros(4, 8, 8))

    def forward(self, x, num_tokens_per_expert):
        return x


def test_experts_of_ones_own_that_break_transformers_contract_are_refused():
    model = _own()
    model.h[1].moe.experts = _CountSplitExperts()
    with pytest.raises(ValueError, match=r"h\.1\.moe\.experts \(_CountSplitExperts\) has no integer "
                                         r"num_experts; h\.1\.moe\.experts\.forward takes \(x, "
                                         r"num_tokens_per_expert\), not \(hidden_states, top_k_index, "
                                         r"top_k_weights\)"):
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


def test_a_plans_ep_with_a_device_mesh_is_refused_not_dropped(world4):
    """A DeviceMesh carries no ep: the Plan's would be dropped without a word (each rank
    then keeps every expert's shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _meta("qwen3_moe")
    plan = annot.plan(model, parallel=annot.ParallelDims(ep=2))
    with pytest.raises(ValueError, match="ask for expert parallelism \\(ep=2\\), which a DeviceMesh cannot carry"):
        annot.auto_wrap(model, "fsdp2", plan, mesh=init_device_mesh("cpu", (4,)))
    assert all(m.num_experts == 4 for n, m in model.named_modules() if n.endswith(".experts"))


def test_fp16_reductions_with_one_copy_per_expert_are_refused_before_the_model_changes(world4):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _meta("qwen3_moe")
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="reduced in torch.float16 with one copy per expert"):
        annot.auto_wrap(model, "fsdp2", mesh=annot.ParallelDims(shard=2, replicate=2, ep=2),
                        mixed_precision=fp16)
    assert not any(hasattr(p, "device_mesh") for p in model.parameters())


def test_a_parameter_of_an_experts_module_left_out_of_the_plan_is_refused():
    model = _meta("gpt_oss")
    model.ep_plan = {k: v for k, v in model.ep_plan.items() if not k.endswith("_bias")}
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj_bias is in an experts module but not split"):
        resolve_expert_plan(model, 2)


def test_each_rank_writes_its_own_expert_rows_in_a_shared_save(world4):
    """FSDP2 over experts split by ep places the stacks as strided shards: each rank's
    rows are still one block, written by that rank, never gathered whole."""
    from annot.checkpoint_io.entries import entry
    from annot.checkpoint_io.shared_save import owned_pieces
    from annot.meta.layout import WHOLE

    model = _meta("qwen3_moe")
    annot.auto_wrap(model, "fsdp2", mesh=annot.ParallelDims(ep=2))  # efsdp 2: sharded copies
    stacks = {n: p for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    assert stacks and all("_StridedShard" in repr(p.placements) for p in stacks.values())
    for name, param in stacks.items():
        pieces = owned_pieces(entry(name, param, WHOLE), dist.get_rank())
        assert pieces is not None and len(pieces) == 1, name
        first, local = pieces[0]
        assert (first, tuple(local.shape)) == (0, (1, *param.shape[1:])), name  # rank 0: expert 0
