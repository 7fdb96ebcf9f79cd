"""Each engine, with and without checkpointing (FSDP2 also with CPU offload; DDP and FSDP2
with activation offload; ZeRO-3 with leaf modules), trains the example GPT on 2 CPU ranks
exactly like one process that sees both ranks' batches.

One torchrun launch runs every scenario (process start-up dominates on 2 cores); each
test then checks one behaviour of one scenario. The reference runs in this process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.engines.harness import (
    BATCH_PER_RANK,
    CONFIG,
    SCENARIOS,
    STEPS,
    TOLERANCE,
    WORKER,
    reference,
)

pytestmark = pytest.mark.distributed

BLOCKS = [f"transformer.h.{i}" for i in range(CONFIG["n_layer"])]


def family(scenario: str) -> str:
    return "deepspeed" if SCENARIOS[scenario]["engine"] == "deepspeed" else "torch"


class Results:
    """Scenario results, launched on first use: one torchrun runs every scenario of the
    families the session's selected parity tests need, the torch engines' first, then
    DeepSpeed's (an optional dependency; its first run on a machine also compiles
    DeepSpeed's shared-memory op, which takes minutes on 2 cores). A family no selected
    test needed at first is launched on its own if asked for later."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, wanted: set[str]) -> None:
        self.tmp = tmp_path_factory
        self.wanted = wanted
        self.done: dict[str, dict] = {}

    def __getitem__(self, scenario: str) -> dict:
        if family(scenario) == "deepspeed":
            pytest.importorskip("deepspeed")
        if scenario not in self.done:
            families = {family(scenario)} | self.wanted
            if importlib.util.find_spec("deepspeed") is None:
                families.discard("deepspeed")
            # SCENARIOS' order: the torch engines first, then DeepSpeed's checkpointed
            # ZeRO-3 before any other deepspeed.initialize in the process.
            scenarios = [s for s in SCENARIOS if family(s) in families and s not in self.done]
            out = self.tmp.mktemp("parity") / "results.pt"
            timeout = 180 + (600 if "deepspeed" in families else 0)
            proc = torchrun(WORKER, str(out), *scenarios, timeout=timeout)
            assert proc.returncode == 0, proc.stdout[-6000:]
            self.done.update(torch.load(out))
        return self.done[scenario]


def _families_selected(session: pytest.Session) -> set[str]:
    """The scenario families the selected tests of this module read."""
    families = set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path == Path(__file__).resolve():
            families |= {family(v) for v in params.values() if v in SCENARIOS}
    return families


@pytest.fixture(scope="session")
def results(request, tmp_path_factory) -> Results:
    return Results(tmp_path_factory, _families_selected(request.session))


@pytest.fixture(scope="session")
def ref() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_loss_at_every_step_matches_single_process(results, ref, scenario):
    losses, _ = ref
    got = results[scenario]["losses"]
    assert len(got) == STEPS
    assert got == pytest.approx(losses, abs=TOLERANCE, rel=0)
    assert losses[0] != pytest.approx(losses[-1], abs=1e-3)  # the steps changed the model


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_full_parameters_match_single_process(results, ref, scenario):
    _, params = ref
    got = results[scenario]["params"]
    assert got.keys() == params.keys()
    for name, expected in params.items():
        torch.testing.assert_close(got[name], expected, atol=TOLERANCE, rtol=0, msg=name)


FSDP1_LEVEL = "_fsdp_wrapped_module."  # FSDP1's own wrapper level, not annot's


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_parameter_and_state_dict_names_unchanged(results, scenario):
    run = results[scenario]
    names = run["names"]
    if SCENARIOS[scenario]["engine"] == "fsdp1":
        assert all(FSDP1_LEVEL in n for n in names)
        names = [n.replace(FSDP1_LEVEL, "") for n in names]
    assert names == run["bare_names"]
    assert run["keys"] == run["bare_keys"]
    assert not any("checkpoint" in m for m in run["modules"])  # no checkpoint wrapper level


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tied_embedding_and_head_stay_one_parameter(results, scenario):
    assert results[scenario]["tied"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_blocks_are_recomputed_in_backward_only_when_checkpointed(results, scenario):
    checkpointed = SCENARIOS[scenario]["checkpoint"] is not False  # the Plan checkpoints blocks
    expected = CONFIG["n_layer"] if checkpointed else 0
    assert results[scenario]["recomputed_per_step"] == expected


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1"])
def test_fsdp_shards_each_block_and_the_root(results, engine):
    assert sorted(results[engine]["fsdp_groups"]) == ["", *BLOCKS]
    assert results["ddp"]["fsdp_groups"] == {}


@pytest.mark.parametrize(
    ("scenario", "offload"), [("fsdp2-checkpoint", False), ("fsdp2-offload-checkpoint", True)]
)
def test_fsdp2_offload_puts_every_group_on_cpu(results, scenario, offload):
    groups = results[scenario]["fsdp_groups"]
    assert {path: g["offload"] for path, g in groups.items()} == dict.fromkeys(["", *BLOCKS], offload)


@pytest.mark.parametrize(("scenario", "reshard"), [("fsdp2", True), ("fsdp2-no-reshard", False)])
def test_fsdp2_reshard_after_forward_reaches_every_block(results, scenario, reshard):
    groups = results[scenario]["fsdp_groups"]
    assert [groups[path]["reshard"] for path in BLOCKS] == [reshard] * len(BLOCKS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_activation_offload_moves_bytes_only_where_asked(results, scenario):
    offloaded = results[scenario]["offloaded_bytes_per_step"]
    if SCENARIOS[scenario].get("offload_activations"):
        # Every block's saved activations: at least the block inputs, batch x length x n_embd
        # floats per block (a loose floor; the exact count is in test_activation_offload).
        per_block = BATCH_PER_RANK * CONFIG["block_size"] * CONFIG["n_embd"] * 4
        assert offloaded >= CONFIG["n_layer"] * per_block
    else:
        assert offloaded == 0


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if family(s) == "deepspeed"])
def test_zero3_leaf_modules_are_what_deepspeed_sees_as_leaves(results, scenario):
    expected = [f"{b}.mlp" for b in BLOCKS] if SCENARIOS[scenario].get("leaf_modules") else []
    assert results[scenario]["z3_leaves"] == expected
