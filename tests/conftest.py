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
