"""Context parallelism (a ``cp`` mesh dimension, FSDP2 and DeepSpeed) on CPU ranks against one
process on the whole sequences (`tests.engines.context_parallel_cases`), the example's
``--cp``, a save with cp 2 resumed with cp 1, and the refusals (no launch).

Each launch trains each model twice: with the default all-gather attention and with
Ulysses (``cp_attention="ulysses"``, an all-to-all over heads; the tiny Llama's 2
key/value heads split as well). Default lane: cp 2 on 2 ranks (one launch, about 26 s on
the shared 2-core machine).
Sweep lane (``-m sweep``): shard 2 x cp 2 and cp 2 x tp 2 on 4 ranks (about 40 s and
30 s) and the example's runs (a 2-rank launch and two single processes, about 30 s).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import annot
from annot.runtime.context_parallel import token_places
from annot.runtime.split_attention import AttentionNotSplittableError, check_attention_modules
from tests.distributed import ROOT, free_port, run_process, torchrun, worker_env
from tests.engines.context_parallel_cases import (
    LAUNCH_TIMEOUT_S,
    LAYOUTS,
    STEPS,
    TOLERANCE,
    WORKER,
    build,
    reference,
)
from tests.resume.test_example_resume import losses as printed_losses

MODELS = ("gpt", "llama")
#: The launches' cases: each model with the default attention and with Ulysses.
CASES = (*MODELS, *(f"{name}:ulysses" for name in MODELS))


def _launch(layout: str, tmp_path) -> dict:
    out = tmp_path / "results.pt"
    torchrun(WORKER, str(out), layout, *CASES, nproc=LAYOUTS[layout]["world"],
             timeout=LAUNCH_TIMEOUT_S)
    return torch.load(out, weights_only=False)


def _launched(layout: str):
    """A module-scoped fixture: one launch of ``layout`` for all the tests that take it."""

    @pytest.fixture(scope="module")
    def launched(tmp_path_factory) -> dict:
        return _launch(layout, tmp_path_factory.mktemp(layout))

    return launched


cp2 = _launched("cp2")
cp2_deepspeed = _launched("cp2-deepspeed")
shard2xcp2 = _launched("shard2xcp2")
cp2xtp2 = _launched("cp2xtp2")


def _far(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_against_one_process(results: dict, case: str, groups: int) -> None:
    ref_losses, ref_grads = reference(case.partition(":")[0], groups)
    got = results[case]
    for step in range(STEPS):
        ranks = got["losses"][step]
        # each rank returns its group's whole-sequence loss; the groups' mean is the loss
        assert abs(sum(ranks) / len(ranks) - ref_losses[step]) <= TOLERANCE, (step, ranks, ref_losses)
        far = {n: _far(g, ref_grads[step][n]) for n, g in got["grads"][step].items()}
        assert sorted(far) == sorted(ref_grads[step])
        assert max(far.values()) <= TOLERANCE, (step, max(far.items(), key=lambda kv: kv[1]))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_cp2_trains_like_one_process_on_whole_sequences(cp2, case):
    _check_against_one_process(cp2, case, groups=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_cp_ranks_return_the_same_loss(cp2):
    for case in CASES:
        assert all(len(set(ranks)) == 1 for ranks in cp2[case]["losses"]), cp2[case]["losses"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_cp2_trains_like_one_process(cp2_deepspeed, case):
    """ZeRO-3 with cp 2: ``ulysses`` cases through DeepSpeed's DistributedAttention."""
    _check_against_one_process(cp2_deepspeed, case, groups=1)
    assert all(len(set(ranks)) == 1 for ranks in cp2_deepspeed[case]["losses"])
    expected = "deepspeed_ulysses_attention" if case.endswith(":ulysses") else "split_attention"
    assert cp2_deepspeed[case]["attention"] == expected


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES)
def test_shard2_x_cp2_trains_like_one_process(shard2xcp2, case):
    _check_against_one_process(shard2xcp2, case, groups=2)


@pytest.mark.distributed
@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES)
def test_cp2_x_tp2_trains_like_one_process(cp2xtp2, case):
    """Context and tensor parallelism together on 4 ranks (about 30 s on 2 cores)."""
    _check_against_one_process(cp2xtp2, case, groups=1)


TRAIN = ROOT / "examples" / "gpt" / "train.py"
EXAMPLE = ["--n_layer", "2", "--n_embd", "32", "--n_head", "2", "--batch_size", "2"]


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict[str, str]:
    """``--cp 2`` on 2 ranks, 3 steps, saving at step 2; one process 3 steps straight; one
    process resuming the cp 2 state (cp 1) for the third step."""
    states = tmp_path_factory.mktemp("states")
    out = {"cp2": torchrun(TRAIN, *EXAMPLE, "--cp", "2", "--steps", "3", "--save-every", "2",
                           "--resume", str(states), timeout=LAUNCH_TIMEOUT_S).stdout}
    for key, args in (("one", ["--steps", "3"]), ("resumed", ["--steps", "3", "--resume", str(states)])):
        env = {**worker_env(), "MASTER_PORT": str(free_port())}
        proc = run_process([sys.executable, str(TRAIN), *EXAMPLE, *args], timeout=LAUNCH_TIMEOUT_S,
                           env=env)
        assert proc.returncode == 0, proc.stdout[-4000:]
        out[key] = proc.stdout
    return out


@pytest.mark.distributed
@pytest.mark.sweep
def test_example_with_cp2_prints_the_losses_of_one_process(example_runs):
    cp2, one = printed_losses(example_runs["cp2"]), printed_losses(example_runs["one"])
    assert sorted(cp2) == sorted(one) == [0, 1, 2]
    assert max(abs(cp2[s] - one[s]) for s in one) <= TOLERANCE, (cp2, one)


@pytest.mark.distributed
@pytest.mark.sweep
def test_a_cp2_state_resumes_with_cp1(example_runs):
    resumed = printed_losses(example_runs["resumed"])
    assert "at step 2, sequence 4 of the data" in example_runs["resumed"]
    assert sorted(resumed) == [2]
    assert abs(resumed[2] - printed_losses(example_runs["one"])[2]) <= TOLERANCE


def test_load_balanced_places_pair_early_and_late_chunks():
    # 16 tokens over 2 ranks: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert token_places(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert token_places(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([token_places(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_a_length_that_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="pad sequences to a multiple of 4"):
        token_places(10, 2, 0)


def test_eager_attention_is_refused_naming_the_module():
    model = build("llama")
    model.config._attn_implementation = "eager"
    with pytest.raises(AttentionNotSplittableError,
                       match=r"model\.layers\.0\.self_attn \(LlamaAttention\).*attn_implementation='sdpa'"):
        check_attention_modules(model)


class _NoPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_a_forward_without_position_ids_is_refused_before_wrapping():
    from annot.runtime.context_parallel import refuse_unsplittable

    with pytest.raises(ValueError, match="_NoPositions.forward takes no position_ids"):
        refuse_unsplittable(_NoPositions())


@pytest.mark.parametrize("engine", ["ddp", "fsdp1"])
def test_engines_without_context_parallelism_refuse_cp(engine):
    from annot.engines.mesh import refuse_context_parallel

    with pytest.raises(ValueError, match=f"engine '{engine}' has no context parallelism"):
        refuse_context_parallel(annot.ParallelDims(cp=2), engine)


def test_deepspeed_takes_parallel_dims_with_cp_only():
    """DeepSpeed's ``mesh=`` is for context parallelism: a device mesh, replicas or
    tensor parallelism are refused before anything changes, naming the fix."""
    from torch.distributed.device_mesh import DeviceMesh

    from annot.engines.deepspeed import DeepSpeedOptions

    with pytest.raises(TypeError, match="takes mesh=annot.ParallelDims\\(cp=N\\).*hpz_partition_size"):
        DeepSpeedOptions(mesh=object.__new__(DeviceMesh))
    with pytest.raises(ValueError, match="cp_attention='ring'"):
        DeepSpeedOptions(cp_attention="ring")
    plan_dims = annot.ParallelDims(cp=2)
    with pytest.raises(ValueError, match="differs from the Plan's parallel dims"):
        from annot.engines.deepspeed import _parallel_dims

        _parallel_dims(annot.ParallelDims(cp=4), plan_dims)


def test_cp_dims_describe_themselves():
    dims = annot.ParallelDims(shard=2, cp=2)
    assert dims.resolve(4).world == 4
    assert annot.ParallelDims(cp=2).resolve(2).sizes == {"replicate": 1, "shard": 1, "cp": 2, "tp": 1}
    assert "cp 2" in dims.describe() and "context parallel" in dims.meaning()
    assert annot.ParallelDims.from_dict(dims.to_dict()) == dims


def test_split_attention_is_whole_causal_attention(monkeypatch):
    # Both ranks of cp 2 in one process: the all-gather is the concatenation of the two
    # ranks' keys (rank order), whose autograd sums each rank's part's gradients as the
    # all-reduce and slice do. fp32; only the order of float additions differs.
    from annot.runtime import split_attention as sa

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    places = [token_places(16, 2, r) for r in range(2)]
    every = torch.cat(places)
    parts = {"k": [k[:, :, p] for p in places], "v": [v[:, :, p] for p in places]}

    def gather(x, group):  # noqa: ANN001, ANN202 (the collective stood in for)
        name = "k" if any(x is t for t in parts["k"]) else "v"
        return torch.cat(parts[name], dim=-2)

    monkeypatch.setattr(sa, "gather_sequence", gather)
    out = torch.zeros_like(whole)
    for rank, p in enumerate(places):
        out[:, :, p] = sa.split_attention(q[:, :, p], parts["k"][rank], parts["v"][rank],
                                          is_causal=True, group=None, query_places=p,
                                          key_places=every)
    assert _far(out, whole) <= 1e-6
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(whole.square().sum(), (q, k, v))
    assert max(_far(a, b) for a, b in zip(grads, expected, strict=True)) <= 1e-5


def test_a_mask_given_to_attention_is_refused():
    from annot.runtime.split_attention import split_attention

    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(AttentionNotSplittableError, match="got an attn_mask"):
        split_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), group=None,
                        query_places=token_places(16, 2, 0), key_places=torch.arange(16))
