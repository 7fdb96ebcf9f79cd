"""`annot plan DIR` and `annot.from_pretrained(DIR)` build the same class: the one the
directory's ``config.architectures`` names (both use `annot.huggingface.model.model_factory`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import annot

# Slow lane: runs `annot plan` in a fresh process that imports transformers.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("cls_name", ["LlamaForSequenceClassification", "LlamaForCausalLM"])
def test_plan_and_from_pretrained_choose_the_class_that_saved_the_directory(tmp_path: Path, cls_name: str):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_labels=3, pad_token_id=0)
    getattr(transformers, cls_name)(config).save_pretrained(tmp_path)

    planned = subprocess.run([sys.executable, "-m", "annot.cli", "plan", str(tmp_path), "--json"],
                             capture_output=True, text=True, check=True)
    built = annot.from_pretrained(tmp_path, engine=None)

    assert json.loads(planned.stdout)["model"] == cls_name
    assert type(built).__name__ == cls_name
