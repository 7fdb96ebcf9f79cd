"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import free_port


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process, for checks that need one."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()
