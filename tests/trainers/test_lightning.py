"""annot's Lightning strategies on 2 CPU ranks, for real: the Trainer and Fabric train the
example GPT with the Plan's units and checkpointing, and every step's loss (mean over the
ranks) equals the single-process reference's (fp32, 1e-6), across Lightning's own
checkpoint save and resume; and Lightning's default ModelParallelStrategy mesh, which
trained unsynchronised copies, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.engines.harness import CONFIG, reference
from tests.requires import installed

pytestmark = installed("lightning")
WORKER = Path(__file__).with_name("lightning_worker.py")
UNITS = [f"model.transformer.h.{i}" for i in range(CONFIG["n_layer"])]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning") / "out.pt"
    torchrun(WORKER, str(out), "lightning-default-mesh", "trainer-fsdp2", "trainer-meta-init",
             "fabric-fsdp2", timeout=300)
    return torch.load(out)


@pytest.fixture(scope="module")
def expected():
    first, _ = reference()
    # The resumed runs see the same batches again; the reference trains on.
    from tests.engines.harness import batches, make_model, make_optimizer
    from tests.reference import train_reference

    both, _ = train_reference(make_model, batches() + batches(), make_optimizer,
                              lambda model, batch: model(*batch)[1])
    assert both[:3] == first
    return both


def close(losses, expected):
    assert len(losses) == len(expected)
    diffs = [abs(a - b) for a, b in zip(losses, expected, strict=True)]
    assert max(diffs) < TOLERANCE, (losses, expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_strategy_matches_one_process_across_save_and_resume(results, expected):
    run = results["trainer-fsdp2"]
    close(run["losses"], expected)
    assert run["units"] == ["", *UNITS]          # the LightningModule is the FSDP2 root
    assert run["mlp_calls_per_block_step"] == 2  # every block recomputed once (marked)
    assert run["dcp_folder"]                     # Lightning's distributed checkpoint


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_empty_init_is_annots_meta_init(results, expected):
    run = results["trainer-meta-init"]
    assert run["built_on_meta"]
    close(run["losses"], expected[:3])
    assert run["mlp_calls_per_block_step"] == 1  # checkpoint=False
    assert run["units"] == ["", *UNITS]


@pytest.mark.distributed
@pytest.mark.slow
def test_fabric_strategy_matches_one_process_across_save_and_load(results, expected):
    run = results["fabric-fsdp2"]
    assert run["built_on_meta"]
    close(run["losses"], expected)
    assert run["units"] == ["", *[u.removeprefix("model.") for u in UNITS]]
    assert run["mlp_calls_per_block_step"] == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_a_data_parallel_mesh_of_one_rank_is_refused(results):
    seen = results["lightning-default-mesh"]
    assert seen["dp"] == 1
    assert "does not cover the 2 ranks" in seen["error"]
    assert "data_parallel_size=2, tensor_parallel_size=1" in seen["error"]
