"""Shared fixtures: the example GPT on the meta device, small HF configs.

``tests`` is a package, so pytest puts the repository root on ``sys.path`` and tests
import ``examples.…`` and shared helpers (``tests.distributed``, ``tests.engines.harness``,
...) absolutely. Fixtures live in conftest files; constants and helpers never do (a
conftest is not imported as a module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# DeepSpeed JIT-builds a CPU op into TORCH_EXTENSIONS_DIR; the tests (and the torchrun
# workers, which inherit the environment) use a folder of their own unless told otherwise,
# so a build another tool killed half way (its stale lock) cannot hang them. .ci/run also
# clears stale locks in its folder before the suite starts.
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      str(Path.home() / ".cache" / "annot-test-torch-extensions"))


def _cuda_found() -> str:
    """What this torch says about CUDA, for a skip reason."""
    return (f"torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} device(s)")


def _leave_out_sweeps(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The sweep lane runs only when a ``-m`` expression names it (``-m sweep``): any
    other run, with or without ``-m``, deselects tests marked ``sweep``. (An ``addopts``
    ``-m 'not sweep'`` would be replaced by the first ``-m`` a user gives.)"""
    if "sweep" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("sweep") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("sweep")])
        items[:] = kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Sweeps left out unless asked for (`_leave_out_sweeps`); the suite's device switch (``ANNOT_TEST_DEVICE``, tests/distributed.py) and the
    ``gpu`` marker: without a CUDA device, a test marked ``gpu`` is skipped with the
    reason, and with ``ANNOT_TEST_DEVICE=cuda`` every test is (nothing would run where
    it was asked to)."""
    from tests.distributed import DEVICE_VARIABLE, test_device

    _leave_out_sweeps(config, items)
    try:
        device = test_device()
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if torch.cuda.is_available():
        return
    everything = pytest.mark.skip(reason=f"{DEVICE_VARIABLE}=cuda: no CUDA device (found: {_cuda_found()})")
    gpu = pytest.mark.skip(reason=f"marked gpu: no CUDA device (found: {_cuda_found()})")
    for item in items:
        if device == "cuda":
            item.add_marker(everything)
        elif item.get_closest_marker("gpu") is not None:
            item.add_marker(gpu)


@pytest.fixture
def device() -> torch.device:
    """The suite's device (``ANNOT_TEST_DEVICE``): ``cuda`` (this process's current CUDA
    device) or ``cpu``."""
    from tests.distributed import test_device

    return torch.device("cuda", torch.cuda.current_device()) if test_device() == "cuda" else torch.device("cpu")


@pytest.fixture
def gpt_meta():
    from examples.gpt.model import GPT

    with torch.device("meta"):
        return GPT(n_layer=3, n_embd=32, n_head=2, vocab_size=64, block_size=16)


@pytest.fixture
def tiny_llama_meta():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process, for checks that need one."""
    import torch.distributed as dist

    from tests.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that leaves a process group in this process fails itself, and the group is
    destroyed: a later test would otherwise find "the default process group twice", or a
    forked child (tests/trust/test_interrupted_save.py) would wait forever in a barrier of
    a group whose threads the fork did not copy."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialized: destroy it "
                    "(dist.destroy_process_group()) or use the one_rank fixture")


@pytest.fixture(autouse=True)
def torch_linear_put_back():
    """A ZeRO-3 run in this process (``deepspeed.zero.Init``) leaves DeepSpeed's linear in
    ``torch.nn.functional.linear`` for the rest of the process (docs/design.md, pitfall
    48): a later test's single-process reference ran DeepSpeed's bias add instead of
    torch's fused one, and a bfloat16 loss moved by 1.6e-5 with the suite's order alone.
    Each test starts with torch's own function; the engine's behaviour inside a test is
    unchanged."""
    import torch.nn.functional as F  # noqa: N812 (torch's own spelling)

    original = torch._C._nn.linear
    F.linear = original
    yield
    F.linear = original
