"""The planner in the user's terms: a DeepSpeed config (dict or file, `--deepspeed-config`)
and DDP options drive the prediction; bad input names the key."""

from __future__ import annotations

import json

import pytest
import torch

import annot
from annot.cli.main import main
from annot.memory import MemoryInputError
from annot.memory.user_config import USER_DEEPSPEED_KEY, read_deepspeed_config
from examples.gpt.model import GPT

GiB = 2**30
# Lightning 1.3's DeepSpeedPlugin(stage=3, cpu_offload=True) with precision=16.
LIGHTNING_13 = {"zero_optimization": {"stage": 3, "contiguous_gradients": True, "overlap_comm": True,
                                      "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8,
                                      "cpu_offload": True},
                "fp16": {"enabled": True}}


def _gpt():
    with torch.device("meta"):
        return GPT(n_layer=2, vocab_size=128, block_size=16, n_head=2, n_embd=32)


def _row(config, **kwargs):
    report = annot.estimate_memory(_gpt(), gpus=2, batch=1, seq=16, gpu_mem=80 * GiB, host_mem=GiB,
                                   deepspeed_config=config, **kwargs)
    return report.row(USER_DEEPSPEED_KEY)


def test_lightning_13_spelling_is_read():
    run = read_deepspeed_config(LIGHTNING_13)
    assert run.strategy.stage == 3 and run.strategy.offload_optimizer == "cpu"
    assert not run.strategy.offload_params and run.precision == "fp16-mixed"
    assert run.zero["reduce_bucket_size"] == 200_000_000
    assert run.zero["stage3_max_reuse_distance"] == 1_000_000_000  # DeepSpeed's default


@pytest.mark.parametrize("config, match", [
    ({"zero_optimization": {"stage": 3, "reduce_bucket": 5}}, "zero_optimization.reduce_bucket"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, "'auto'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs stage 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, "offload_optimizer.device"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
])
def test_a_bad_config_names_the_key(config, match):
    with pytest.raises(MemoryInputError, match=match):
        read_deepspeed_config(config)


def test_the_reduce_bucket_of_the_config_is_in_the_row():
    small = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1_000}, "fp16": {"enabled": True}}
    large = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1_000_000}, "fp16": {"enabled": True}}
    a, b = _row(small), _row(large)
    assert a.detail.parts["reduce bucket"] == 1_000 * 2  # fp16 elements
    assert b.gpu - a.gpu == (1_000_000 - 1_000) * 2


def test_the_reuse_distance_keeps_units_gathered():
    kept = _row({"zero_optimization": {"stage": 3}})
    released = _row({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}})
    # A model this small fits any distance: every unit stays gathered by default.
    assert kept.detail.parts.get("parameters kept for reuse", 0) > 0
    assert released.detail.parts.get("parameters kept for reuse", 0) == 0


def test_a_config_file_and_the_command_line(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(LIGHTNING_13))
    assert _row(str(path)).label == read_deepspeed_config(LIGHTNING_13).strategy.label
    target = "examples/gpt/model.py:GPT"
    code = main(["plan", target, "--kwargs", json.dumps(dict(n_layer=2, vocab_size=128, block_size=16,
                                                               n_head=2, n_embd=32)),
                 "--memory", "--gpus", "2", "--seq", "16", "--deepspeed-config", str(path)])
    assert code == 0
    assert "your DeepSpeed config (ZeRO-3, optimizer on CPU)" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage3_prefetch": 1}}')
    assert main(["plan", target, "--memory", "--deepspeed-config", str(tmp_path / "bad.json")]) == 2
    assert "zero_optimization.stage3_prefetch" in capsys.readouterr().err


def test_ddp_without_bucket_views_holds_the_gradients_twice():
    common = dict(gpus=2, batch=1, seq=16, gpu_mem=80 * GiB, host_mem=GiB, precision="fp32",
                  optimizer="sgd")
    views = annot.estimate_memory(_gpt(), **common).row("ddp")
    copies = annot.estimate_memory(_gpt(), **common, ddp_options={"gradient_as_bucket_view": False}).row("ddp")
    assert "gradient_as_bucket_view=False" in copies.call
    assert copies.detail.parts["activations"] > views.detail.parts["activations"]
    with pytest.raises(MemoryInputError, match="bucket_cap_mb"):
        annot.estimate_memory(_gpt(), **common, ddp_options={"bucket_cap_mb": 25})
