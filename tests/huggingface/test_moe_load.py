"""Mixture-of-experts checkpoints written by transformers 5 (one key per expert) load
into the fused 3-D expert weights slice by slice, with transformers' own conversions
(`annot.formats.transformers_conversions`, read through `annot.checkpoint_io.converted`): the planning in one process, the whole model, and
FSDP2 on 2 ranks against transformers' single-process ``from_pretrained``."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

import annot
from annot.checkpoint_io.converted import read, read_flat, read_into
from annot.formats.transformers_conversions import plan_conversions
from annot.formats.transformers_keys import key_rules
from tests.distributed import torchrun
from tests.huggingface.moe_models import (
    GRAD_ATOL,
    LOSS_RTOL,
    MOE_MODELS,
    batch,
    build,
    config,
    plain,
    save,
)

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("moe_load_worker.py")
LAYER = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe")


def _meta_model(name: str) -> torch.nn.Module:
    import transformers

    with torch.device("meta"):
        return getattr(transformers, MOE_MODELS[name][1])(config(name))


def _file_sources(name: str) -> dict[str, torch.Tensor]:
    """The state dict transformers' ``save_pretrained`` writes for ``name`` (one tensor
    per expert), without writing it."""
    from transformers.core_model_loading import revert_weight_conversion

    model = build(name)
    return revert_weight_conversion(model, model.state_dict())


def _recording_reader(values: dict[str, torch.Tensor], reads: list[tuple[str, tuple, tuple]]):
    def reader(key: str, start: tuple, shape: tuple) -> torch.Tensor:
        reads.append((key, start, shape))
        return values[key][tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))].clone()
    return reader


def test_shard_of_fused_experts_reads_only_its_experts_rows():
    """Qwen3-MoE's gate_up_proj [4 experts, 2*32, 64] is gate and up stacked per expert,
    then concatenated: rows of experts [2, 4) and, inside them, rows [16, 48) (half of
    gate, half of up) read only those experts' gate/up rows, and equal transformers'
    fused tensor there."""
    values = _file_sources("qwen3_moe")
    model = _meta_model("qwen3_moe")
    plan = plan_conversions(model, key_rules(model), {k: (tuple(v.shape), v.dtype) for k, v in values.items()})
    node = plan.targets[LAYER + "gate_up_proj"]
    fused = build("qwen3_moe").state_dict()[LAYER + "gate_up_proj"]
    assert node.shape == tuple(fused.shape)
    reads: list[tuple[str, tuple, tuple]] = []
    block = read(node, (2, 16, 0), (2, 32, 64), _recording_reader(values, reads))
    assert torch.equal(block, fused[2:4, 16:48])
    prefix = "model.layers.1.mlp.experts."
    assert sorted(reads) == sorted(
        [(f"{prefix}{e}.gate_proj.weight", (16,  0), (16, 64)) for e in (2, 3)]
        + [(f"{prefix}{e}.up_proj.weight", (0, 0), (16, 64)) for e in (2, 3)])


def test_block_read_into_a_strided_destination_equals_transformers():
    """`read_into` fills the parameter's own memory, whatever its strides (here a
    permuted view, as a transposed parameter would be), with the same values `read`
    returns, and refuses a destination of another shape."""
    values = _file_sources("qwen3_moe")
    model = _meta_model("qwen3_moe")
    plan = plan_conversions(model, key_rules(model), {k: (tuple(v.shape), v.dtype) for k, v in values.items()})
    node = plan.targets[LAYER + "gate_up_proj"]
    fused = build("qwen3_moe").state_dict()[LAYER + "gate_up_proj"]
    out = torch.full((64, 32, 2), float("nan")).permute(2, 1, 0)
    read_into(node, (2, 16, 0), (2, 32, 64), _recording_reader(values, []), out)
    assert not out.is_contiguous() and torch.equal(out, fused[2:4, 16:48])
    with pytest.raises(ValueError, match="destination"):
        read_into(node, (2, 16, 0), (2, 32, 64), _recording_reader(values, []), torch.empty(2, 32, 63))


def test_flat_range_of_fused_experts_equals_transformers():
    """A flat shard (FSDP1, ZeRO-3) of Mixtral's fused gate_up_proj: the elements of a
    range that starts and ends inside rows, read as the rows covering it."""
    values = _file_sources("mixtral")
    model = _meta_model("mixtral")
    plan = plan_conversions(model, key_rules(model), {k: (tuple(v.shape), v.dtype) for k, v in values.items()})
    fused = build("mixtral").state_dict()[LAYER + "gate_up_proj"]
    start, stop = 64 * 64 + 5, 3 * 64 * 64 - 7  # inside expert 1 to inside expert 2
    reads: list[tuple[str, tuple, tuple]] = []
    flat = read_flat(plan.targets[LAYER + "gate_up_proj"], start, stop, _recording_reader(values, reads))
    assert torch.equal(flat, fused.reshape(-1)[start:stop])
    assert {key.split(".experts.")[1].split(".")[0] for key, _, _ in reads} == {"1", "2"}


def test_unsupported_operation_is_refused_by_name():
    """A converter whose operation reshapes (transformers' Interleave) cannot be read as
    slices: refused, naming the tensor and the operation."""
    from transformers.core_model_loading import Interleave, MergeModulelist, WeightConverter

    values = _file_sources("qwen3_moe")
    model = _meta_model("qwen3_moe")
    rules = key_rules(model)
    interleaved = WeightConverter(source_patterns="mlp.experts.*.down_proj.weight",
                                  target_patterns="mlp.experts.down_proj",
                                  operations=[MergeModulelist(dim=0), Interleave(dim=1)])
    rules = dataclasses.replace(rules, converters=[interleaved])
    with pytest.raises(annot.CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*Interleave.*reshape"):
        plan_conversions(model, rules, {k: (tuple(v.shape), v.dtype) for k, v in values.items()})


def _whole_model_equal(name: str, root: Path) -> None:
    directory = save(name, root)
    ours = annot.from_pretrained(directory, engine=None).state_dict()
    theirs = plain(directory).state_dict()
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []


# The fast lane loads Qwen3-MoE into a whole model; the sweep lane the other three.
@pytest.mark.parametrize("name", [n if n == "qwen3_moe" else pytest.param(n, marks=pytest.mark.sweep)
                                  for n in MOE_MODELS])
def test_whole_model_load_equals_transformers(moe_dirs, name):
    _whole_model_equal(name, moe_dirs)


@pytest.mark.parametrize("name", [n if n == "mixtral" else pytest.param(n, marks=pytest.mark.sweep)
                                  for n in MOE_MODELS])
def test_annot_save_loads_in_transformers_with_equal_logits(moe_dirs, tmp_path, name):
    """annot.save writes the model's own (fused) names; transformers 5.24 loads them as
    they are (its converters match only per-expert keys)."""
    ours = annot.from_pretrained(save(name, moe_dirs), engine=None)
    annot.save(ours, tmp_path / "saved")
    theirs = plain(tmp_path / "saved")
    inputs = batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(ours(input_ids=inputs).logits, theirs(input_ids=inputs).logits)


def _launch(runs: list[tuple[str, str]], moe_dirs: Path, out: Path) -> dict:
    """One 2-rank launch of ``moe_load_worker.py`` for ``(engine, model)`` runs."""
    torchrun(WORKER, str(out), *(f"{engine}:{save(name, moe_dirs)}" for engine, name in runs), timeout=600)
    return {spec.partition(":")[0] + ":" + Path(spec.partition(":")[2]).name: result
            for spec, result in torch.load(out, weights_only=False).items()}


def _assert_equal_to_transformers(run: dict, what: str) -> None:
    assert "error" not in run, f"{what}:\n{run.get('error')}"
    assert run["state"].keys() == run["plain_state"].keys(), what
    assert [n for n in run["state"] if not torch.equal(run["state"][n], run["plain_state"][n])] == [], what
    assert run["loss"] == pytest.approx(run["plain_loss"], rel=LOSS_RTOL), what


@pytest.mark.distributed
def test_fsdp2_from_pretrained_equals_transformers(moe_dirs, tmp_path):
    """All four models in one 2-rank launch, without and with expert parallelism
    (``ParallelDims(ep=2)``: 2 of the 4 experts per rank): parameters bitwise equal to
    transformers' ``from_pretrained``, fused experts split across ranks, loss within 1e-5
    relative and every gradient within 1e-4 of the single-process model; with experts
    split, `annot.save`'s output loads in transformers bitwise equal."""
    runs = [(engine, name) for engine in ("fsdp2", "fsdp2-ep") for name in MOE_MODELS]
    results = _launch(runs, moe_dirs, tmp_path / "results.pt")
    for engine, name in runs:
        run, what = results[f"{engine}:{name}"], f"{engine}: {name}"
        _assert_equal_to_transformers(run, what)
        assert any(n.startswith(LAYER) for n in run["sharded"]), what
        assert run["grads"].keys() == run["plain_grads"].keys(), what
        for n, grad in run["plain_grads"].items():
            torch.testing.assert_close(run["grads"][n], grad, rtol=0, atol=GRAD_ATOL, msg=f"{what}: {n}")
        split = set(run["local_experts"].values())
        assert split == ({2} if engine == "fsdp2-ep" else {4}), what  # 4 experts, 2 per rank with ep=2
        if engine == "fsdp2-ep":  # annot.save's output: transformers loads the same weights
            assert [n for n in run["plain_state"] if not torch.equal(run["saved_state"][n], run["plain_state"][n])] == []


@pytest.mark.sweep
@pytest.mark.distributed
def test_flat_shards_and_mapping_equal_transformers(moe_dirs, tmp_path):
    """FSDP1 and DeepSpeed ZeRO-3 (flat shards: the rows covering each range are read)
    and FSDP2 with ``mmap=True`` (converted tensors are read, the rest mapped), every
    model, one launch: parameters bitwise equal to transformers' and the loss within
    1e-5 relative."""
    engines = ["fsdp2-mmap", "fsdp1"]
    if importlib.util.find_spec("deepspeed") is not None:
        engines.append("deepspeed")
    runs = [(engine, name) for engine in engines for name in MOE_MODELS]
    results = _launch(runs, moe_dirs, tmp_path / "results.pt")
    for engine, name in runs:
        _assert_equal_to_transformers(results[f"{engine}:{name}"], f"{engine}: {name}")
