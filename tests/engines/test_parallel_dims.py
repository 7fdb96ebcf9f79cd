"""Parallel dimensions as sizes (`annot.ParallelDims`) and device meshes read by name,
checked without a launch: sizes against a world, the Plan table, and the refusals on a
4-rank world of torch's fake process group (collectives do nothing; wrapping runs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import annot
from annot.engines.mesh import build_mesh, data_parallel_mesh
from examples.gpt.model import GPT


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)


@pytest.fixture
def world4():
    """A 4-rank world in this process (torch's fake process group: this is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_sizes_resolve_against_the_world():
    assert annot.ParallelDims(replicate=2).resolve(16).sizes == {"replicate": 2, "shard": 8, "cp": 1, "tp": 1}
    assert annot.ParallelDims(replicate=2, shard=2, tp=2).resolve(8).world == 8
    assert annot.ParallelDims().resolve(1).sizes == {"replicate": 1, "shard": 1, "cp": 1, "tp": 1}


@pytest.mark.parametrize(("dims", "world", "match"), [
    (dict(replicate=2, shard=3), 4, "spans 6 ranks, but the world has 4.*product is 4"),
    (dict(replicate=3), 4, "not a multiple of 3.*divide 4"),
    (dict(replicate=4), 4, "leaves shard=1.*nothing is sharded.*smaller replicate"),
    (dict(replicate=1, shard=1), 4, "spans 1 ranks, but the world has 4"),
])
def test_sizes_that_do_not_fit_the_world_name_the_fix(dims, world, match):
    with pytest.raises(ValueError, match=match):
        annot.ParallelDims(**dims).resolve(world)


@pytest.mark.parametrize(("dims", "match"), [
    (dict(replicate=0), "positive int, or -1"),
    (dict(replicate=-1, shard=-1), "both -1"),
    (dict(tp=True), "positive int"),
])
def test_bad_sizes_are_refused_when_built(dims, match):
    with pytest.raises(ValueError, match=match):
        annot.ParallelDims(**dims)


def test_the_plan_table_and_json_carry_the_dims():
    dims = annot.ParallelDims(replicate=2, shard=4)
    plan = annot.plan(gpt(), parallel=dims)
    assert ("parallel: replicate 2 x shard 4 x tp 1 (8 ranks): HSDP: 2 replicas, each sharded "
            "over 4 ranks") in plan.table()
    assert annot.Plan.from_json(plan.to_json()).parallel == dims
    assert "parallel" not in annot.plan(gpt()).to_dict()  # only when given


def test_annot_plan_shows_the_dims_of_the_cluster(capsys):
    from annot.cli.main import main

    args = ["plan", "examples/gpt/model.py:GPT", "--kwargs", '{"n_layer": 2}']
    assert main([*args, "--parallel", "replicate=2", "--gpus", "8", "--nodes", "2"]) == 0
    assert "parallel: replicate 2 x shard 8 x tp 1 (16 ranks)" in capsys.readouterr().out
    assert main([*args, "--parallel", "replicate=3", "--gpus", "8"]) == 2
    assert "--gpus 8 x --nodes 1" in capsys.readouterr().err


def test_dims_build_a_named_mesh_and_the_engines_get_its_data_parallel_part(world4):
    mesh = build_mesh(annot.ParallelDims(replicate=2), "cpu")
    assert mesh.mesh_dim_names == ("replicate", "shard", "tp")
    hsdp = data_parallel_mesh(mesh)
    assert (hsdp.mesh_dim_names, tuple(hsdp.mesh.shape)) == (("replicate", "shard"), (2, 2))
    flat = data_parallel_mesh(build_mesh(annot.ParallelDims(), "cpu"))
    assert (flat.mesh_dim_names, flat.size()) == (("shard",), 4)  # replicate 1: plain sharding


def test_fsdp2_takes_dims_or_the_plans_dims(world4):
    model = annot.auto_wrap(gpt(), "fsdp2", mesh=annot.ParallelDims(replicate=2))
    weight = model.transformer.h[0].mlp.c_fc.weight
    assert [str(p) for p in weight.placements] == ["R", "S(0)"]
    model = gpt()
    plan = annot.plan(model, parallel=annot.ParallelDims(replicate=2))
    assert tuple(annot.auto_wrap(model, "fsdp2", plan).lm_head.weight.device_mesh.mesh.shape) == (2, 2)
    with pytest.raises(ValueError, match="differs from the Plan's parallel dims"):
        annot.auto_wrap(gpt(), "fsdp2", plan, mesh=annot.ParallelDims(replicate=4, shard=1))


def test_fsdp1_hybrid_shards_from_the_dims(world4):
    from torch.distributed.fsdp import ShardingStrategy

    wrapped = annot.auto_wrap(gpt(), "fsdp1", mesh=annot.ParallelDims(replicate=2))
    assert wrapped.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    assert (wrapped.process_group.size(), wrapped._inter_node_pg.size()) == (2, 2)
    zero2 = annot.auto_wrap(gpt(), "fsdp1", mesh=annot.ParallelDims(replicate=2),
                            reshard_after_forward=False)
    assert zero2.sharding_strategy == ShardingStrategy._HYBRID_SHARD_ZERO2


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1"])
def test_dims_that_do_not_fit_are_refused_before_the_model_changes(world4, engine):
    model = gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="not a multiple of 3"):
        annot.auto_wrap(model, engine, mesh=annot.ParallelDims(replicate=3))
    assert all(torch.equal(p, before[n]) and not hasattr(p, "device_mesh")
               for n, p in model.named_parameters())


def test_tensor_parallel_dims_need_a_tensor_parallel_plan(world4):
    dims = annot.ParallelDims(shard=2, tp=2)
    # FSDP2 applies tensor parallelism on the "tp" dimension: the example GPT carries no
    # plan of its own, so it needs tp_plan=.
    with pytest.raises(annot.PlanError, match="carries no tensor-parallel plan"):
        annot.auto_wrap(gpt(), "fsdp2", mesh=dims)
    with pytest.raises(annot.EngineNotAvailableError, match="tensor parallelism is engine='fsdp2'"):
        annot.auto_wrap(gpt(), "fsdp1", mesh=dims)


@pytest.mark.parametrize(("names", "shape", "match"), [
    (("shard", "replicate"), (2, 2), "out of order.*mesh_dim_names=\\('replicate', 'shard'\\)"),
    (("dp", "tp"), (2, 2), "reads a named mesh by the names.*by position"),
    (None, (2, 1, 2), "unnamed 3-D mesh"),
])
def test_a_mesh_torch_would_read_by_position_against_its_names_is_refused(world4, names, shape, match):
    # fully_shard and FSDP1 read a 2-D mesh as (replicate, shard) by position: a mesh
    # named ("shard", "replicate") would shard over the ranks it calls replicas.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for engine in ("fsdp2", "fsdp1"):
        with pytest.raises(ValueError, match=match):
            annot.auto_wrap(gpt(), engine, mesh=mesh)


def test_an_unnamed_2d_mesh_is_hybrid_on_fsdp1_and_needs_names_on_fsdp2(world4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy

    wrapped = annot.auto_wrap(gpt(), "fsdp1", mesh=init_device_mesh("cpu", (2, 2)))
    assert wrapped.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    with pytest.raises(ValueError, match="mesh_dim_names=\\('replicate', 'shard'\\)"):
        annot.auto_wrap(gpt(), "fsdp2", mesh=init_device_mesh("cpu", (2, 2)))


@pytest.mark.parametrize(("engine", "match"), [("ddp", "engine='fsdp2' or 'fsdp1'"),
                                               ("deepspeed", "hpz_partition_size=N")])
def test_engines_without_meshes_refuse_a_plans_hybrid_dims(world4, engine, match):
    model = gpt()
    plan = annot.plan(model, parallel=annot.ParallelDims(replicate=2))
    with pytest.raises(ValueError, match=f"need a device mesh.*{match}"):
        annot.auto_wrap(model, engine, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1"])
def test_dims_without_a_process_group_get_annots_error(engine):
    assert not dist.is_initialized()
    with pytest.raises(annot.ProcessGroupNotInitializedError, match=f"engine '{engine}' needs torch.distributed"):
        annot.auto_wrap(gpt(), engine, mesh=annot.ParallelDims(replicate=2))


def test_cp_is_flattened_with_shard_for_fsdp2(world4):
    from annot.engines.mesh import context_parallel_mesh

    mesh = build_mesh(annot.ParallelDims(shard=2, cp=2), "cpu")
    assert mesh.mesh_dim_names == ("replicate", "shard", "cp", "tp")
    flat = data_parallel_mesh(mesh)
    assert (flat.mesh_dim_names, flat.size()) == (("shard_cp",), 4)
    assert context_parallel_mesh(mesh).size() == 2
    hybrid = data_parallel_mesh(build_mesh(annot.ParallelDims(replicate=2, cp=2), "cpu"))
    assert (hybrid.mesh_dim_names, tuple(hybrid.mesh.shape)) == (("replicate", "shard_cp"), (2, 2))
    model = annot.auto_wrap(gpt(), "fsdp2", mesh=annot.ParallelDims(shard=2, cp=2),
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert model.module.lm_head.weight.device_mesh.mesh_dim_names == ("shard_cp",)
    assert model.context_parallel is not None and model.context_parallel.size == 2


def test_cp_without_an_optimizer_is_refused(world4):
    with pytest.raises(ValueError, match="context parallelism .* needs optimizer="):
        annot.auto_wrap(gpt(), "fsdp2", mesh=annot.ParallelDims(shard=2, cp=2))


def test_expert_parallel_splits_the_data_parallel_ranks_without_spanning_its_own():
    dims = annot.ParallelDims(ep=2).resolve(4)
    assert (dims.sizes, dims.ep, dims.world) == ({"replicate": 1, "shard": 4, "cp": 1, "tp": 1}, 2, 4)
    assert annot.ParallelDims.from_dict(dims.to_dict()) == dims
    assert "ep" not in annot.ParallelDims().to_dict()  # plans without experts read as before
    assert "experts split over 2 ranks" in dims.meaning()


@pytest.mark.parametrize(("dims", "world", "match"), [
    (dict(ep=3), 4, "ep=3 must divide the data-parallel ranks.*= 4"),
    (dict(shard=2, tp=2, ep=4), 4, "ep=4 must divide the data-parallel ranks.*= 2"),
])
def test_expert_parallel_that_does_not_divide_the_data_parallel_ranks_is_refused(dims, world, match):
    with pytest.raises(ValueError, match=match):
        annot.ParallelDims(**dims).resolve(world)


def test_expert_parallel_takes_no_rest_of_the_world():
    with pytest.raises(ValueError, match="ep takes no rest of the world"):
        annot.ParallelDims(ep=-1)


@pytest.mark.parametrize(("engine", "match"), [
    ("fsdp1", "expert parallelism \\(ep=2\\) is not available on engine 'fsdp1'.*use engine='fsdp2'"),
    ("ddp", "expert parallelism \\(ep=2\\) is not available on engine 'ddp'"),
    ("deepspeed", "expert parallelism \\(ep=2\\) is not available on engine 'deepspeed'"),
    # FSDP2 splits experts it can find: a dense GPT has none.
    ("fsdp2", "expert parallelism \\(ep=2\\): GPT has no experts module annot can find"),
])
def test_expert_parallel_is_refused_before_the_model_changes(world4, engine, match):
    model = gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = annot.plan(model, parallel=annot.ParallelDims(ep=2))
    with pytest.raises(ValueError, match=match):
        annot.auto_wrap(model, engine, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert all(torch.equal(p, before[n]) and not hasattr(p, "device_mesh")
               for n, p in model.named_parameters())
