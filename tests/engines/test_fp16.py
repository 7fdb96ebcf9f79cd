"""fp16 compute with loss scaling on the torch engines (FSDP2, FSDP1, DDP), 2 CPU ranks.

The loss is multiplied by 2^-20, so its gradients lie below fp16's smallest subnormal:
without scaling every update is zero, with the `Trainable`'s scaler it is fp32's. One
torchrun launch runs every engine (`fp16_worker.py`); each test checks one behaviour.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("fp16_worker.py")
ENGINES = ["fsdp2", "fsdp1", "ddp"]
SCALERS = {"fsdp2": "ShardedGradScaler", "fsdp1": "ShardedGradScaler", "ddp": "GradScaler"}
# Relative norm of (fp16 update - fp32 update) over the whole model after 2 SGD steps
# with momentum. fp16 compute rounds every activation to 11 significant bits (unit
# roundoff 2^-11, 4.9e-4) through 3 blocks: measured 6.4e-3 (FSDP2, FSDP1) and 6.0e-3
# (DDP, autocast keeps norms and softmax in fp32). Unscaled, the error is 1 (no update).
UPDATE_TOLERANCE = 1.5e-2
# The gradient norm clip_grad_norm_ reports against fp32's: measured 3.4e-4 (FSDP), 5e-5 (DDP).
NORM_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    import torch

    folder = tmp_path_factory.mktemp("fp16")
    out = folder / "out.pt"
    torchrun(WORKER, str(out), str(folder), *ENGINES, timeout=400)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_fp16_has_the_engines_scaler(results, engine):
    assert results[engine]["scaler"] == SCALERS[engine]


@pytest.mark.parametrize("engine", ENGINES)
def test_unscaled_fp16_gradients_underflow(results, engine):
    # The premise of the next test: without the scaler nothing trains.
    assert results[engine]["unscaled_changed_fraction"] == 0.0


@pytest.mark.parametrize("engine", ENGINES)
def test_scaled_fp16_matches_the_fp32_update(results, engine):
    run = results[engine]
    assert run["skipped_in_training"] == 0  # the first scale fits an fp16 loss's gradient
    assert run["relative_error"] < UPDATE_TOLERANCE, run["worst_parameter"]


@pytest.mark.parametrize("engine", ENGINES)
def test_clip_grad_norm_sees_unscaled_gradients(results, engine):
    got, fp32 = results[engine]["norm"]
    assert abs(got - fp32) / fp32 < NORM_TOLERANCE


@pytest.mark.parametrize("engine", ENGINES)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(results, engine):
    skip = results[engine]["skip"]
    assert skip["params_equal"] == [True, True]
    assert skip["momenta_equal"] == [True, True]
    assert skip["skipped_steps"] == [1, 1]
    before, after = skip["scale"]
    assert after == before / 2  # torch's backoff factor


@pytest.mark.parametrize("engine", ENGINES)
def test_a_skipped_step_is_logged_once_on_rank_0(results, engine):
    rank0, rank1 = results[engine]["skip"]["warnings"]
    assert len(rank0) == 1 and "step skipped" in rank0[0] and "1 skipped so far" in rank0[0]
    assert rank1 == []


@pytest.mark.parametrize("engine", ENGINES)
def test_the_scaler_state_round_trips_through_save_and_load_state(results, engine):
    trip = results[engine]["round_trip"]
    assert trip["fresh"] != trip["saved"]  # a fresh scaler differs, so the load did it
    assert trip["loaded"] == trip["saved"]
    assert trip["skipped_steps"] == 1
