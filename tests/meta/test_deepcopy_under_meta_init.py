"""``copy.deepcopy`` inside `annot.meta_init` (PEFT's ``modules_to_save`` copies the
embedding or head it trains): the copy is recorded as a clone of its source, and the
process's heap stays sound. Before, FakeTensor's own deepcopy corrupted it: later
allocations aborted ("corrupted double-linked list") or crashed in 4 of 5 runs of the
script below, and a loaded embedding could hold other memory's bytes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import annot

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
#: glibc's malloc checking, which aborts at the first corrupted chunk it frees.
MALLOC_DEBUG = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")

SCRIPT = """
import copy, gc, torch, transformers, annot
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
with annot.meta_init():
    model = transformers.LlamaForCausalLM(config)
    parameters = copy.deepcopy(model.model.embed_tokens._parameters)
for _ in range(4):
    kept = [torch.randn(64, 32) for _ in range(300)]
    gc.collect()
print("survived")
"""


def _config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2)


def test_a_module_deep_copied_under_meta_init_is_a_clone_of_its_source():
    with annot.meta_init():
        model = transformers.LlamaForCausalLM(_config())
        model.copied = copy.deepcopy(model.model.embed_tokens)
    annot.materialize(model)
    source, copied = model.model.embed_tokens.weight, model.copied.weight
    assert copied is not source and copied.data_ptr() != source.data_ptr()
    assert torch.equal(copied, source) and copied.requires_grad and isinstance(copied, torch.nn.Parameter)


def test_deep_copying_fake_parameters_leaves_the_heap_sound():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_CHECK_": "3"}
    if MALLOC_DEBUG.exists():
        env["LD_PRELOAD"] = str(MALLOC_DEBUG)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
