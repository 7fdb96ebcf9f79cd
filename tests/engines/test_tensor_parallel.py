"""Tensor parallel 2 x FSDP2 2 on 4 CPU ranks against one process
(`tests.engines.tensor_parallel_cases` says what each rank sees), and the refusals of
plans that cannot be split (no launch).

One torchrun launch runs every scenario; each test checks one behaviour.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import annot
from annot.engines.mesh import split_mesh
from annot.engines.tensor_parallel import check_tensor_parallel, torch_style
from annot.policies import PlanError
from annot.policies.tensor_parallel import model_tp_plan, resolve_tp_plan
from tests.distributed import torchrun
from tests.engines.tensor_parallel_cases import (
    LAUNCH_TIMEOUT_S,
    STEPS,
    TOLERANCE,
    WORKER,
    WORLD,
    build,
    gpt_rule,
    reference,
)

MODELS = ("llama", "gpt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    scratch = tmp_path_factory.mktemp("tp")
    build("llama", seed=1).save_pretrained(scratch / "llama-weights")
    annot.save(build("gpt", seed=1), scratch / "gpt-weights")
    out = scratch / "results.pt"
    names = [f"{kind}:{model}" for model in MODELS for kind in ("train", "meta", "load")]
    names += ["pretrained:llama", "mapped:llama"]
    torchrun(WORKER, str(out), str(scratch), *names, nproc=WORLD, timeout=LAUNCH_TIMEOUT_S)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple]:
    return {name: reference(name) for name in MODELS}


def _far(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_trains_like_one_process(results, references, name):
    losses, grads, params = references[name]
    got = results[f"train:{name}"]
    assert len(got["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(got["losses"], losses, strict=True)) < TOLERANCE
    for step, (theirs, ours) in enumerate(zip(got["grads"], grads, strict=True)):
        assert theirs.keys() == ours.keys()
        worst = max(theirs, key=lambda n: _far(theirs[n], ours[n]))
        assert _far(theirs[worst], ours[worst]) < TOLERANCE, (step, worst)
    assert max(_far(got["params"][n], params[n]) for n in params) < TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
def test_split_layers_are_two_dimensional(results):
    """The split layers are sharded over both mesh dimensions: FSDP2 over the data-parallel
    one (strided where both split dim 0), torch's TP styles over "tp"."""
    llama = results["train:llama"]["placements"]
    assert llama["model.layers.0.self_attn.q_proj.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert llama["model.layers.0.self_attn.o_proj.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert llama["model.embed_tokens.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert llama["model.norm.weight"] == ["Shard(dim=0)"]  # not split: data parallel only
    gpt = results["train:gpt"]["placements"]
    assert gpt["transformer.h.0.mlp.c_proj.bias"] == ["Shard(dim=0)", "Replicate()"]
    assert gpt["transformer.h.0.attn.c_attn.weight"] == ["Shard(dim=0)"]


def _assert_every_block_right(got: dict) -> None:
    """A worker's comparison of every tensor it built or loaded with the eager model's:
    names were compared, none differs, and each rank holds its own block of each."""
    assert got["names"] and got["mismatched"] == [] and got["own_blocks_wrong"] == []


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_meta_init_is_bitwise_eager(results, name):
    _assert_every_block_right(results[f"meta:{name}"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_sharded_load_reads_only_own_block(results, name):
    got = results[f"load:{name}"]
    _assert_every_block_right(got)
    for read, kept in got["read_and_kept"]:
        assert read == kept, got["read_and_kept"]


@pytest.mark.distributed
@pytest.mark.slow
def test_from_pretrained_reads_into_the_split_layout(results):
    _assert_every_block_right(results["pretrained:llama"])


@pytest.mark.distributed
@pytest.mark.slow
def test_mapped_from_pretrained_maps_row_blocks_and_reads_column_blocks(results):
    """``mmap=True`` into TP 2 x FSDP2 2: every block right; what no rank could map is
    exactly the row-wise split weights (a column block is not one byte range)."""
    got = results["mapped:llama"]
    _assert_every_block_right(got)
    assert got["column_blocks"] and len(got["column_blocks"]) < len(got["names"])
    assert got["not_mapped"] == got["column_blocks"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_save_round_trip(results, name):
    from safetensors.torch import load_file

    got = results[f"train:{name}"]
    files = sorted(Path(got["saved"]).glob("*.safetensors"))
    saved = {k: v for f in files for k, v in load_file(f).items()}
    for n, value in got["params"].items():
        if n in saved:  # a tied parameter is saved once, under its first name
            assert torch.equal(saved[n], value), n
    assert got["state_params_mismatched"] == [] and got["state_momentum_mismatched"] == []
    if name == "llama":  # what transformers itself reads back
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(got["saved"])
        assert all(torch.equal(p, got["params"][n]) for n, p in model.named_parameters())


# ---- plan translation and refusals (no launch) ----


def test_llama_plan_is_its_own_with_every_layer_resolved():
    model = build("llama")
    plan = resolve_tp_plan(model, None)
    assert model_tp_plan(model)["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.1.mlp.up_proj"] == "colwise"
    assert len(plan) == 2 + 7 * 2


def test_rule_matches_path_ends():
    plan = resolve_tp_plan(build("gpt"), gpt_rule())
    assert plan == {f"transformer.h.{i}.mlp.{leaf}": style for i in range(2)
                    for leaf, style in (("c_fc", "colwise"), ("c_proj", "rowwise"))}


def test_styles_are_torch_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert isinstance(torch_style("colwise"), ColwiseParallel)
    assert torch_style("colwise").output_layouts == (Shard(-1),)
    assert torch_style("colwise_gather_output").output_layouts == (Replicate(),)
    assert isinstance(torch_style("rowwise"), RowwiseParallel)
    assert torch_style("rowwise_split_input").input_layouts == (Replicate(),)


@pytest.mark.parametrize("style, words", [
    ("packed_colwise", "packed projection"),
    ("sequence_parallel", "layout its neighbours"),
    ("nonsense", "unknown style"),
])
def test_unapplied_styles_are_refused(style, words):
    with pytest.raises(PlanError, match=words):
        resolve_tp_plan(build("llama"), {"model.layers.*.mlp.up_proj": style})


def test_pattern_matching_nothing_is_refused():
    with pytest.raises(PlanError, match="matches no module"):
        resolve_tp_plan(build("gpt"), annot.tp_rule(colwise=["mlp.up_proj"], rowwise=["mlp.c_proj"]))


def test_model_without_plan_needs_a_rule():
    with pytest.raises(PlanError, match="no tensor-parallel plan"):
        resolve_tp_plan(build("gpt"), None)


def test_heads_not_divisible_are_refused():
    with pytest.raises(PlanError, match="num_key_value_heads=2 is not divisible by tp=4"):
        check_tensor_parallel(build("llama"), None, 4)


def test_unnamed_head_count_is_refused():
    """The GPT's attention reshapes by ``n_head``: splitting its Linears without saying
    what to do with it could mix heads silently."""
    rule = annot.tp_rule(colwise=["attn.c_attn"], rowwise=["attn.c_proj"])
    with pytest.raises(PlanError, match=r"n_head=2 .*local_heads=\['n_head'\]"):
        check_tensor_parallel(build("gpt"), rule, 2)


def test_tied_parameter_split_on_one_side_is_refused():
    with pytest.raises(PlanError, match="one tied parameter"):
        check_tensor_parallel(build("gpt"), annot.tp_rule(colwise=["lm_head"]), 2)


def test_uneven_split_is_refused():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    with pytest.raises(PlanError, match="out_features=6, not divisible by tp=4"):
        check_tensor_parallel(model, {"0": "colwise", "1": "rowwise"}, 4)


def test_local_heads_are_divided():
    from annot.engines.tensor_parallel import TensorParallelPlan

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head = 4
            self.q = nn.Linear(8, 8)

    model = nn.Sequential(Attention())
    plan = check_tensor_parallel(model, annot.tp_rule(colwise=["q"], local_heads=["n_head"]), 2)
    assert plan == TensorParallelPlan({"0.q": "colwise"}, {"0": ("n_head",)})


def test_tp_plan_without_tp_mesh_is_refused():
    with pytest.raises(ValueError, match="needs mesh= with a 'tp' dimension"):
        annot.FSDP2Options(tp_plan=gpt_rule(), mesh=annot.ParallelDims(tp=1))


def test_mesh_with_tp_not_innermost_is_refused():
    class Mesh:  # what split_mesh reads of a DeviceMesh
        mesh_dim_names = ("tp", "shard")
        ndim = 2

    with pytest.raises(ValueError, match="out of order: replicate must be outermost and tp innermost"):
        split_mesh(Mesh())  # type: ignore[arg-type]
