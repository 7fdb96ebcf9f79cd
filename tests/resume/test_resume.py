"""Whole training runs checkpointed and resumed with `annot.save_state` / `annot.load_state`
on CPU ranks: 6 steps uninterrupted against 3 steps, a save, new processes, a load, 3
steps, for FSDP2, FSDP1, DDP, ZeRO-2, ZeRO-3 and ZeRO-1 with bf16 and fp32 gradient
accumulation (DeepSpeed's BF16_Optimizer; AdamW with weight decay and a LambdaLR
warm-up, so optimizer and scheduler state both matter); across engines; resharded from 2
ranks to 1 and 4; a save killed half way; per-rank peak bytes during save and load.

Launches: one 2-rank save (every engine, then the killed save; FSDP2's, FSDP1's and
ZeRO-3's saves are asynchronous, committed after the following steps), one 2-rank resume
(every same-engine and cross-engine pair), one 1-rank and one 4-rank resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("resume_worker.py")
ENGINES = ["fsdp2", "fsdp1", "ddp", "zero2", "zero3"]
# Trains in bf16, so apart from the fp32 engines (which agree among themselves to 1e-6);
# resumed on itself only.
BF16 = "zero1-bf16"
# Saved and resumed in this one order. An engine built earlier in a process can move a
# later one's results in the last bits: DDP and ZeRO-1 bf16 resumed in a process that
# had run ZeRO-2 alone ended off their uninterrupted runs' bits (which had followed
# FSDP2, FSDP1, ZeRO-2 and ZeRO-3), with the same losses; in the same order, bitwise.
SAME = [*ENGINES, BF16]
CROSS = ["fsdp2:zero3", "zero3:fsdp2", "fsdp1:fsdp2", "fsdp2:fsdp1"]
ON_ONE = ["fsdp2:fsdp2", "fsdp1:fsdp1", "ddp:ddp", "zero2:zero2", "zero3:zero3", "zero3:fsdp2"]
ON_FOUR = ["fsdp2:fsdp2", "fsdp1:fsdp1", "zero3:zero3"]
SPLIT = 3
# Resharded or across engines the gradient sums run in another order: float rounding.
TOLERANCE = 1e-6
# Above this rank's share of the whole model and optimizer state: DCP's and the
# allocator's own buffers (measured at most ~100 KB on this model).
OVERHEAD = 256 * 1024
# Rank 0 also coordinates DCP's plan: it gathers every rank's pickled plan (~34 KB each
# for this model) and scatters the global one, in buffers of world x plan bytes, several
# alive at once: at 4 ranks 8 plans' worth at rank 0's peak here, 13 in one CI run (the
# profiler's memory events). They grow with the world and the tensor count, not bytes:
# rank 0 is allowed 4 x world plans of 40 KB (16 at 4 ranks, 3 more than the most seen).
PLAN = 40 * 1024


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("states")


@pytest.fixture(scope="module")
def saved(root: Path) -> dict:
    """Every engine's uninterrupted run (saved at step 3), then the killed save: rank 1
    SIGKILLs itself inside the step-4 save, so the launch fails by design."""
    pytest.importorskip("deepspeed")
    out = root / "saved.pt"
    proc = torchrun(WORKER, str(out), "save", str(root), *SAME, "kill", timeout=600, check=False)
    assert proc.returncode != 0 and "SIGKILL" in proc.stdout, proc.stdout[-3000:]
    assert out.is_file(), proc.stdout[-3000:]
    return torch.load(out, weights_only=False)


def gap(saved: dict, pair: str, run: dict) -> float:
    """How far ``run``'s losses are from the uninterrupted run of the state it resumed."""
    reference = saved[pair.split(":")[0]]["losses"][SPLIT:]
    return max(abs(a - b) for a, b in zip(run["losses"], reference, strict=True))


def resume(root: Path, saved: dict, pairs: list[str], nproc: int) -> dict:
    out = root / f"resumed-{nproc}.pt"
    torchrun(WORKER, str(out), "resume", str(root), *pairs, nproc=nproc, timeout=600)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def on_two(root: Path, saved: dict) -> dict:
    return resume(root, saved, [f"{e}:{e}" for e in SAME] + CROSS + ["kill:fsdp2"], 2)


@pytest.mark.parametrize("engine", SAME)
def test_resume_is_bitwise_on_the_same_engine_and_world(saved, on_two, engine):
    run = on_two[f"{engine}:{engine}"]
    assert run["step"] == SPLIT
    assert run["losses"] == saved[engine]["losses"][SPLIT:]  # exactly
    assert run["extra"] == {"epoch": 0, "next_row": SPLIT * 4}


@pytest.mark.parametrize("engine", SAME)
def test_resume_ends_with_the_uninterrupted_runs_parameters_and_optimizer_state(saved, on_two, engine):
    """Bitwise, rank by rank: every tensor a rank keeps of the model and of the optimizer
    (master partitions, moments, step counts) after the last step, read from the
    engine's own objects. FSDP2, FSDP1 and ZeRO-3 saved asynchronously."""
    for rank, (want, got) in enumerate(zip(saved[engine]["final"], on_two[f"{engine}:{engine}"]["final"],
                                           strict=True)):
        differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        assert not differ, (rank, differ[:8])


def test_zero1_bf16_with_fp32_accumulation_runs_deepspeeds_bf16_optimizer(saved):
    """The configuration of issue #30 (ZeRO-1, bf16, ``grad_accum_dtype: fp32``) is the
    one DeepSpeed wraps in BF16_Optimizer, not ZeRO's optimizer, so the tests above
    round-trip that wrapper."""
    assert saved[BF16]["optimizer"] == "BF16_Optimizer"


@pytest.mark.parametrize("engine", SAME)
def test_annot_load_reads_the_model_weights_of_a_training_state(on_two, engine):
    """``annot.load(model, state)`` (weights only, each rank its part) gives every rank
    the same values `load_state` then gives it."""
    assert on_two[f"{engine}:{engine}"]["annot_load_matches"] == [True, True]


@pytest.mark.parametrize("engine", SAME)
def test_scheduler_and_each_ranks_rng_come_back(saved, on_two, engine):
    run = on_two[f"{engine}:{engine}"]
    assert run["rng_restored"]
    draws = run["draws"]
    assert draws == saved[engine]["draws"]  # rank by rank
    assert draws[0] != draws[1]  # the ranks' streams differ, so each got its own back


@pytest.mark.parametrize("pair", CROSS)
def test_resume_across_engines(saved, on_two, pair):
    assert gap(saved, pair, on_two[pair]) <= TOLERANCE


def test_all_engines_train_alike(saved):
    """The resumed runs are compared with their own engine's uninterrupted run; the
    engines agree among themselves too, so cross-engine resumes have one reference."""
    first = saved["fsdp2"]["losses"]
    for engine in ENGINES:
        assert max(abs(a - b) for a, b in zip(saved[engine]["losses"], first, strict=True)) <= TOLERANCE


def test_a_killed_save_leaves_the_previous_state_loadable(root, saved, on_two):
    import annot
    from annot.checkpoint_io import commit

    kill = root / "kill"
    assert commit.is_committed(kill / "step-00000003")
    partial = kill / ".step-00000004.partial"
    assert partial.is_dir() and not commit.is_committed(partial)
    assert annot.latest_state(kill) == kill / "step-00000003"
    # The next launch resumed from step 3 and continued as the uninterrupted run did.
    assert on_two["kill:fsdp2"]["step"] == SPLIT
    assert on_two["kill:fsdp2"]["losses"] == saved["fsdp2"]["losses"][SPLIT:]
    # Naming the interrupted save is refused, with what it lacks.
    with pytest.raises(annot.CheckpointError) as refused:
        commit.require_committed(partial)
    message = str(refused.value)
    assert "no commit marker" in message and ".metadata" in message and "trainer_state.json" in message
    assert "rng-rank00000.json" not in message  # written before the kill: not missing


def test_save_keeps_the_last_k(root, saved):
    state = root / "fsdp2" / "step-00000003"
    assert [p.name for p in (root / "fsdp2").iterdir()] == ["step-00000003"]
    record = json.loads((state / "COMMITTED").read_text())
    assert {".metadata", "trainer_state.json", "rng-rank00000.json", "rng-rank00001.json"} <= set(record["files"])


def _bound(saved: dict, engine: str, world: int, rank: int) -> int:
    full = saved[engine]["bytes"]
    coordinator = 4 * world * PLAN if rank == 0 else 0
    if engine == "zero2":  # parameters whole on every rank, optimizer state partitioned
        return full["model"] + full["optimizer"] // world + OVERHEAD + coordinator
    return (full["model"] + full["optimizer"]) // world + OVERHEAD + coordinator


def _within(peaks: list[int], saved: dict, engine: str) -> bool:
    """Every rank's peak within its own bound."""
    world = len(peaks)
    return all(peak <= _bound(saved, engine, world, rank) for rank, peak in enumerate(peaks))


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "zero2", "zero3"])
def test_no_rank_holds_the_whole_state_while_saving_or_loading(saved, on_two, engine):
    whole = saved[engine]["bytes"]["model"] + saved[engine]["bytes"]["optimizer"]
    # A rank holding the whole state would break its bound (ZeRO-2 keeps the model whole:
    # its bounds are the loosest, still a partitioned optimizer state's below).
    assert _bound(saved, engine, 2, rank=1) < 0.8 * whole
    assert _bound(saved, engine, 2, rank=0) < whole
    assert _within(saved[engine]["save_peak"], saved, engine), saved[engine]["save_peak"]
    peaks = on_two[f"{engine}:{engine}"]["load_peak"]
    assert _within(peaks, saved, engine), peaks


@pytest.mark.slow
def test_reshard_to_one_rank(root, saved):
    on_one = resume(root, saved, ON_ONE, 1)
    for pair in ON_ONE:
        assert on_one[pair]["step"] == SPLIT
        assert not on_one[pair]["rng_restored"]  # 2 ranks' streams do not map onto 1
        assert gap(saved, pair, on_one[pair]) <= TOLERANCE, pair


@pytest.mark.slow
@pytest.mark.sweep  # 4 ranks on 2 cores, about 24 s; the default run reshards to one rank
def test_reshard_to_four_ranks(root, saved):
    on_four = resume(root, saved, ON_FOUR, 4)
    for pair in ON_FOUR:
        assert gap(saved, pair, on_four[pair]) <= TOLERANCE, pair
        engine = pair.split(":")[0]
        assert _bound(saved, engine, 4, rank=0) < 0.65 * sum(saved[engine]["bytes"].values())
        assert _within(on_four[pair]["load_peak"], saved, engine), (pair, on_four[pair]["load_peak"])
