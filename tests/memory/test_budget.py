"""`fit_budget` / ``annot plan --memory --budget``: the exact solver against brute force,
answers within their budget, larger budgets never slower, the Plan's choices at run time.
The 2-rank counted run and the Llama-3-8B sweep are in test_budget_sweep.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch

import annot
from annot.cli.main import main
from annot.memory.budget import BudgetError, budget_solver
from annot.memory.choices import held
from annot.memory.solver import solve
from annot.memory.strategies import MemoryInputError
from annot.policies import Action, Plan, PlanError
from annot.runtime.activation_checkpoint import torch_checkpoint
from annot.runtime.selective_checkpoint import apply_plan_checkpointing
from examples.gpt.model import GPT
from tests.test_cli_plan import GPT as GPT_TARGET

TINY = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, block_size=32)
EXACT = dict(margin=0.0, reserve=0)  # budgets compared with counted bytes directly


def brute_force(held_, cost, limits, final):
    """The least cost over every assignment (the oracle)."""
    best = None
    for picks in itertools.product(*(range(len(h)) for h in held_)):
        prefix, ok = 0.0, True
        for i, c in enumerate(picks):
            if prefix > limits[i]:
                ok = False
                break
            prefix += held_[i][c]
        if ok and prefix <= final:
            total = sum(cost[i][c] for i, c in enumerate(picks))
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_solver_equals_brute_force_on_random_blocks(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 5), rng.randint(2, 5)
    held_ = [[rng.randint(0, 9) for _ in range(k)] for _ in range(n)]
    cost = [[rng.choice([0.0, 0.5, 1.0, 2.5, 4.0]) for _ in range(k)] for _ in range(n)]
    limits = [rng.randint(0, 25) for _ in range(n)]
    final = rng.randint(0, 30)
    found, expected = solve(held_, cost, limits, final), brute_force(held_, cost, limits, final)
    if expected is None:
        assert found is None
        return
    assert found is not None and found[0] == pytest.approx(expected)
    # The picks it returns reach that cost.
    assert sum(cost[i][c] for i, c in enumerate(found[1])) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(10))
def test_past_its_cap_the_solver_still_answers_within_every_limit(seed, monkeypatch):
    import annot.memory.solver as solver_module

    monkeypatch.setattr(solver_module, "FRONT_CAP", 3)
    rng = random.Random(seed)
    n = 6
    held_ = [[rng.randint(0, 9) + rng.random() for _ in range(4)] for _ in range(n)]
    cost = [[rng.random() * 4 for _ in range(4)] for _ in range(n)]
    limits, final = [rng.uniform(10, 30) for _ in range(n)], rng.uniform(10, 40)
    found, best = solve(held_, cost, limits, final), brute_force(held_, cost, limits, final)
    if found is None:
        return  # merging may lose every fitting prefix; it never invents one
    prefix = 0.0
    for i, c in enumerate(found[1]):
        assert prefix <= limits[i]
        prefix += held_[i][c]
    assert prefix <= final and best is not None and found[0] >= best - 1e-9


def test_the_solver_on_128_blocks_checkpoints_exactly_what_the_budget_needs():
    # none: 10 bytes held, free; checkpoint: 1 byte, cost 1. 128 blocks within 500 bytes
    # need c checkpoints with 10 (128 - c) + c <= 500: c = 87.
    n = 128
    found = solve([[10, 1]] * n, [[0.0, 1.0]] * n, [1e9] * n, 500)
    assert found is not None
    assert found[0] == 87 and found[1].count(1) == 87


@pytest.fixture(scope="module")
def tiny_solver():
    with torch.device("meta"):
        model = GPT(**TINY)
    return budget_solver(model, gpus=2, batch=2, seq=32, precision="fp32", device="cpu",
                         strategies=["fsdp2", "ddp"], **EXACT)


def test_the_solver_equals_brute_force_on_a_small_gpt(tiny_solver):
    from annot.memory.choices import choice_seconds

    s = annot.memory.strategy("fsdp2")
    st, points = tiny_solver.setting(s), tiny_solver.points(s)
    allowed = tiny_solver._allowed(s)
    held_ = [[held(b, c) for c in allowed] for b in st.blocks]
    cost = [[choice_seconds(b, c, tiny_solver.dev) for c in allowed] for b in st.blocks]
    plain = tiny_solver._model_peak(s, dict.fromkeys(tiny_solver.paths, "none"))
    for share in (0.8, 0.9, 0.95, 1.0):
        limit = share * plain
        limits = [limit - b.keep - e for b, e in zip(st.blocks, points.extra, strict=True)]
        found = tiny_solver._solve(s, limit)
        expected = brute_force(held_, cost, limits, limit - points.head) if points.bare <= limit else None
        assert (found is None) == (expected is None)
        if found is not None:
            assert found[0] == pytest.approx(expected)


@pytest.mark.parametrize("key", ["fsdp2", "ddp"])
def test_with_every_block_kept_the_model_gives_the_traced_peak(tiny_solver, key):
    s = annot.memory.strategy(key)
    modelled = tiny_solver._model_peak(s, dict.fromkeys(tiny_solver.paths, "none"))
    assert modelled == tiny_solver._memory(s, tiny_solver.setting(s).trace).device


@pytest.fixture(scope="module")
def every_engine_solver():
    with torch.device("meta"):
        model = GPT(**TINY)
    return budget_solver(model, gpus=2, batch=2, seq=32, precision="bf16-mixed", device="H100", **EXACT)


def test_the_engine_memory_of_every_stretch_equals_asking_stretch_by_stretch(every_engine_solver):
    """`_engine_at` reads every stretch's engine memory from one evaluation; asking
    the engine model once per stretch, with only that stretch's activations set to a
    huge value, is the definition. Equal for every strategy (DDP and FSDP1 at world 1
    price the whole step's peak, ZeRO-3 never its stretches' ends)."""
    solver, big = every_engine_solver, 1 << 50
    assert len(solver.strategies) >= 8
    for s in solver.strategies:
        trace = solver.setting(s).trace
        at = solver._engine_at(s, trace, big)
        assert len(at) == len(trace.segments)
        for k in range(len(trace.segments)):
            for which in (0, 1):
                marked = tuple((ph, u, big if (j, 0) == (k, which) else 0, big if (j, 1) == (k, which) else 0)
                               for j, (ph, u, _, _) in enumerate(trace.segments))
                device = solver._memory(s, dataclasses.replace(
                    trace, peak=big, peak_with_grads=big + trace.grads, segments=marked)).device
                assert at[k][which] == (device - big if device >= big else None), (s.key, k, which)


def test_larger_budgets_never_predict_a_slower_step_and_every_answer_fits(tiny_solver):
    smallest, _ = tiny_solver.smallest_budget()
    assert smallest is not None
    steps = []
    for factor in (1.0, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0):
        try:
            answer = tiny_solver.fit(int(smallest * factor))
        except BudgetError:
            continue
        assert answer.peak_bytes <= answer.budget_bytes
        steps.append(answer.step_time_s)
    assert len(steps) >= 5
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:], strict=False)), steps


def test_nothing_fitting_names_the_smallest_budget(tiny_solver):
    with pytest.raises(BudgetError, match="the smallest budget that would is") as info:
        tiny_solver.fit(1000)
    assert info.value.smallest is not None and info.value.smallest > 1000


def test_the_answer_plan_names_its_choices_and_round_trips(tiny_solver):
    blocks = dict(zip(tiny_solver.paths, ["selective", "checkpoint_offload", "none"], strict=True))
    plan = tiny_solver.plan_for(blocks)
    units = {u.path: u for u in plan.units}
    assert units["transformer.h.0"].checkpoint_policy == "save_matmuls"
    assert units["transformer.h.0"].has(Action.CHECKPOINT)
    assert units["transformer.h.1"].offload_activations and units["transformer.h.1"].has(Action.CHECKPOINT)
    assert not units["transformer.h.2"].has(Action.CHECKPOINT)
    assert Plan.from_json(plan.to_json()) == plan


def test_an_unknown_checkpoint_policy_is_refused():
    with torch.device("meta"):
        plan = annot.plan(GPT(**TINY))
    data = plan.to_dict()
    data["units"][0]["checkpoint_policy"] = "save_everything"
    with pytest.raises(PlanError, match="unknown checkpoint policy 'save_everything'"):
        Plan.from_dict(data)


def test_selective_checkpointing_is_exact_against_no_checkpointing():
    torch.manual_seed(0)
    model = GPT(**{**TINY, "dropout": 0.1})  # random ops must replay the same
    plan = annot.plan(model)
    plan = dataclasses.replace(plan, units=tuple(
        dataclasses.replace(u, checkpoint_policy="save_matmuls") for u in plan.units))
    import copy

    selective = copy.deepcopy(model)
    apply_plan_checkpointing(selective, plan, plan.paths(Action.CHECKPOINT), torch_checkpoint)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    losses = []
    for m in (model, selective):
        torch.manual_seed(1)
        loss = m(x, y)[1]
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-6
    for a, b in zip(model.parameters(), selective.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("engine", "field", "what"), [
    ("deepspeed", "checkpoint_policy", "a selective checkpoint"),
    ("deepspeed", "offload_activations", "activation offload"),
    ("fsdp1", "offload_activations", "activation offload"),
])
def test_an_engine_that_cannot_run_a_choice_refuses_it_by_unit(engine, field, what):
    model = GPT(**TINY)
    plan = annot.plan(model)
    value = "save_matmuls" if field == "checkpoint_policy" else True
    plan = dataclasses.replace(plan, units=(dataclasses.replace(plan.units[0], **{field: value}),
                                            *plan.units[1:]))
    with pytest.raises(annot.EngineNotAvailableError, match=f"asks {what} for transformer.h.0"):
        annot.auto_wrap(model, engine, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_budget_json_on_the_command_line(capsys):
    code = main(["plan", GPT_TARGET, "--kwargs", json.dumps(TINY), "--memory", "--gpus", "2",
                 "--batch", "2", "--seq", "32", "--precision", "fp32", "--device", "cpu",
                 "--margin", "0", "--reserve", "0", "--budget", "64MiB", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["budget_bytes"] == 64 * 2**20
    assert data["peak_bytes"] <= data["budget_bytes"]
    assert data["call"].startswith(f'annot.auto_wrap(model, "{annot.memory.strategy(data["strategy"]).engine}", plan')
    assert set(data["blocks"]) == {f"transformer.h.{i}" for i in range(3)}
    assert data["step_time_s"] > 0


def test_budget_that_nothing_fits_exits_3_with_one_line(capsys):
    code = main(["plan", GPT_TARGET, "--kwargs", json.dumps(TINY), "--memory", "--gpus", "2",
                 "--batch", "2", "--seq", "32", "--precision", "fp32", "--device", "cpu",
                 "--budget", "1MiB"])
    _, err = capsys.readouterr()
    assert code == 3
    assert len(err.strip().splitlines()) == 1 and "the smallest budget that would is" in err


def test_the_plot_is_drawn_or_matplotlib_is_named(tiny_solver, tmp_path):
    from annot.memory.plot import KINDS, plot_budget, stacked

    smallest, _ = tiny_solver.smallest_budget()
    answer = tiny_solver.fit(int(smallest * 1.5))
    bars = stacked(answer)
    assert set(bars) == {"FSDP2", "DDP"} and all(set(b) == set(KINDS) for b in bars.values())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(MemoryInputError, match="needs matplotlib"):
            plot_budget(answer, tmp_path / "budget.png")
        return
    for name in ("budget.png", "budget.svg"):
        assert plot_budget(answer, tmp_path / name).stat().st_size > 0


def test_the_torch_engines_offload_the_units_the_plan_asks_and_no_other():
    from annot.engines.base import checkpoint_and_offload_activations
    from annot.runtime.activation_checkpoint import is_checkpointed
    from annot.runtime.activation_offload import activation_offloader

    model = GPT(**TINY)
    plan = annot.plan(model)
    plan = dataclasses.replace(plan, units=(
        dataclasses.replace(plan.units[0], offload_activations=True), *plan.units[1:]))
    checkpoint_and_offload_activations(model, plan, plan.paths(Action.CHECKPOINT), False)
    offloader = activation_offloader(model)
    assert offloader is not None
    x = torch.randint(0, 256, (2, 32))
    model(x, x)[1].backward()
    # Block 0 is checkpointed and offloaded: its checkpoint saves one tensor, its input.
    assert offloader.packed_tensors == 1
    assert all(is_checkpointed(model.get_submodule(p)) for p in plan.paths(Action.CHECKPOINT))
    # Not checkpointed, block 0 alone offloads everything it saves, the others nothing.
    alone = GPT(**TINY)
    checkpoint_and_offload_activations(alone, plan, [], None)
    alone(x, x)[1].backward()
    every = GPT(**TINY)
    checkpoint_and_offload_activations(every, plan, [], True)
    every(x, x)[1].backward()
    assert 1 < activation_offloader(alone).packed_tensors < activation_offloader(every).packed_tensors


@pytest.mark.sweep  # every strategy traced: the budget chooser's cp is tested in the default
# lane by tests/memory/test_context_parallel.py; this is the command line's wiring
def test_budget_on_the_command_line_weighs_the_cp_sizes_given(capsys):
    code = main(["plan", GPT_TARGET, "--kwargs", json.dumps(TINY), "--memory", "--gpus", "2",
                 "--batch", "2", "--seq", "32", "--precision", "fp32", "--device", "cpu",
                 "--margin", "0", "--reserve", "0", "--budget", "64MiB", "--json",
                 "--cp", "2", "--cp-attention", "ulysses"])
    out, _ = capsys.readouterr()
    assert code == 0
    weighed = {s["key"]: s for s in json.loads(out)["strategies"]}
    assert weighed["fsdp2-cp2"]["label"] == "FSDP2 + CP 2 Ulysses"
