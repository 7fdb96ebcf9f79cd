"""`annot plan`: targets, options, and every error path with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from annot.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt/model.py:GPT"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_of_the_example(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--json")
    assert code == 0
    data = json.loads(out)
    assert [u["path"] for u in data["units"]] == [f"transformer.h.{i}" for i in range(4)]
    assert all(u["actions"] == ["shard", "checkpoint"] for u in data["units"])
    assert data["tied"] == [["transformer.wte.weight", "lm_head.weight"]]


def test_plan_table_with_kwargs_and_rules(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--kwargs", '{"n_layer": 2}', "--policy", "class:Block",
                       "--checkpoint", "every(2, class:Block)")
    assert code == 0
    assert "transformer.h.1  Block" in out
    assert "2 units: 2 shard, 1 checkpoint, 0 offload" in out


def test_plan_config_file_json_and_yaml(capsys, tmp_path):
    (tmp_path / "c.json").write_text('{"n_layer": 5}')
    (tmp_path / "c.yaml").write_text("n_layer: 6\n")
    for name, layers in (("c.json", 5), ("c.yaml", 6)):
        code, out, _ = run(capsys, "plan", GPT, "--config", str(tmp_path / name), "--json")
        assert code == 0 and len(json.loads(out)["units"]) == layers


def test_plan_group_tied_and_offload_flags(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--policy", "class:Embedding | class:Block",
                       "--offload", "class:Block", "--offload-to", "nvme", "--group-tied", "--json")
    assert code == 0
    units = json.loads(out)["units"]
    [grouped] = [u for u in units if u.get("group")]
    assert grouped["path"] == "transformer.wte" and grouped["group"] == ["lm_head"]
    assert {u["path"]: u.get("offload_to") for u in units}["transformer.h.3"] == "nvme"


def test_plan_hf_architecture(capsys):
    pytest.importorskip("transformers")
    kwargs = ('{"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, '
              '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}')
    code, out, _ = run(capsys, "plan", "hf:llama", "--kwargs", kwargs, "--json")
    assert code == 0
    data = json.loads(out)
    assert [u["path"] for u in data["units"]] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert data["units"][0]["cls"].endswith("LlamaDecoderLayer")


def test_plan_hf_directory(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    code, out, _ = run(capsys, "plan", str(tmp_path), "--json")
    assert code == 0
    assert [u["path"] for u in json.loads(out)["units"]] == ["transformer.h.0", "transformer.h.1"]


def test_plan_dtype_option(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--dtype", "bfloat16", "--json")
    assert code == 0
    assert set(json.loads(out)["total_bytes"]) == {"bfloat16"}


SYNTAX_ERROR = "def f(:\n"
BAD_IMPORT = "import no_such_module_x\n"
EXITS_AT_IMPORT = "import sys\nfrom torch import nn\n\nclass M(nn.Module):\n    pass\n\nsys.exit(0)\n"
EXITS_IN_CONSTRUCTOR = (
    "import sys\nfrom torch import nn\n\nclass M(nn.Module):\n"
    "    def __init__(self):\n        sys.exit(0)\n"
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make_argv, message",
    [
        (lambda t: ["plan", f"{t}/missing.py:GPT"], "missing.py: no such file"),
        (lambda t: ["plan", f"{t}/nothing"], "no such file or directory"),
        (lambda t: ["plan", GPT.replace(":GPT", ":Nope")], "no class Nope (nn.Module classes there:"),
        (lambda t: ["plan", GPT.replace(":GPT", ":GPTConfig")], "GPTConfig is not an nn.Module class"),
        (lambda t: ["plan", GPT.replace(":GPT", "")], "name the class too"),
        (lambda t: ["plan", GPT, "--kwargs", "{bad"], "--kwargs: bad JSON"),
        (lambda t: ["plan", GPT, "--kwargs", "[1]"], "--kwargs: expected a JSON object"),
        (lambda t: ["plan", GPT, "--kwargs", '{"n_head": 5}'], "GPT(**{'n_head': 5}) failed"),
        (lambda t: ["plan", GPT, "--config", f"{t}/none.json"], "--config"),
        (lambda t: ["plan", GPT, "--config", str(t)], "is a folder; give the JSON or YAML file in it"),
        (lambda t: ["plan", str(_write(t, SYNTAX_ERROR)) + ":M"], "m.py:1:7: syntax error"),
        (lambda t: ["plan", str(_write(t, BAD_IMPORT)) + ":M"], "importing it failed"),
        (lambda t: ["plan", str(_write(t, EXITS_AT_IMPORT)) + ":M"],
         'importing it called sys.exit(0) before annot could read its classes: put the script '
         'part under `if __name__ == "__main__":`'),
        (lambda t: ["plan", str(_write(t, EXITS_IN_CONSTRUCTOR)) + ":M"], "M(**{}) called sys.exit(0)"),
        (lambda t: ["plan", "hf:no_such_arch"], "unknown transformers model type 'no_such_arch'"),
        (lambda t: ["plan", str(t)], "directory has no config.json"),
        (lambda t: ["plan", GPT, "--policy", "klass:X"], "unknown rule 'klass:X'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, make_argv, message):
    code, out, err = run(capsys, *make_argv(tmp_path))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("annot plan: error: ")
    assert message in err


def test_invalid_plan_exits_1_with_the_reasons(capsys):
    code, _, err = run(capsys, "plan", GPT, "--policy", "class:Nothing")
    assert code == 1
    assert "invalid plan: rule class(Nothing) selects no module for shard" in err


@pytest.mark.parametrize("argv", [["plan"], ["plan", GPT, "--gpus", "two"], ["plot"]])
def test_usage_error_is_one_line_and_exits_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and "--help)" in err, err


def test_a_script_exiting_at_import_sees_its_own_argv(capsys, tmp_path):
    """A file that parses sys.argv at import reads its own name, not annot's arguments."""
    script = ("import sys\nfrom torch import nn\nassert sys.argv[1:] == [], sys.argv\n\n"
              "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.lin = nn.Linear(2, 2)\n")
    code, out, err = run(capsys, "plan", str(_write(tmp_path, script)) + ":M", "--policy", "class:Linear")
    assert (code, err) == (0, "")
    assert "lin" in out


def _refuse_inside(monkeypatch, folder: Path) -> None:
    """What a folder without read and search permission does to everyone but root (the
    tests run as root, who may look into any folder): a stat of anything inside fails."""
    import os

    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if Path(os.fspath(path)).parent == folder:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)


def test_an_unreadable_model_directory_is_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _refuse_inside(monkeypatch, tmp_path)
    code, out, err = run(capsys, "plan", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (f"annot plan: error: {tmp_path}: cannot read ({tmp_path}/config.json): Permission "
                   "denied; make it readable for this user (e.g. chmod u+rx on the folder, u+r on the files)\n")


def test_a_model_file_in_an_unreadable_folder_is_one_line(capsys, tmp_path, monkeypatch):
    _write(tmp_path, "from torch import nn\n\nclass M(nn.Module):\n    pass\n")
    _refuse_inside(monkeypatch, tmp_path)
    code, out, err = run(capsys, "plan", f"{tmp_path}/m.py:M")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "cannot read" in err and "Permission denied" in err, err


@pytest.mark.slow
def test_console_script_runs_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "annot.cli", "plan", f"{tmp_path}/nope.py:X"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == f"annot plan: error: {tmp_path}/nope.py: no such file"


def test_a_config_dataclass_constructor_is_filled_from_kwargs(capsys, tmp_path):
    model_file = tmp_path / "nano.py"
    model_file.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "from torch import nn\n"
        "import annot\n\n"
        "@dataclass\n"
        "class NanoConfig:\n"
        "    n_layer: int = 2\n\n"
        "@annot.shard_block\n"
        "class Layer(nn.Linear):\n"
        "    pass\n\n"
        "class Nano(nn.Module):\n"
        "    def __init__(self, config: NanoConfig) -> None:\n"
        "        super().__init__()\n"
        "        self.layers = nn.ModuleList(Layer(4, 4) for _ in range(config.n_layer))\n"
    )
    code, out, _ = run(capsys, "plan", f"{model_file}:Nano", "--kwargs", '{"n_layer": 3}', "--json")
    assert code == 0
    assert len(json.loads(out)["units"]) == 3
    assert json.loads(out)["units"][0]["cls"] == "nano.Layer"


@pytest.mark.slow
def test_plan_memory_table_and_recommendation(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--memory", "--gpus", "2", "--batch", "4", "--seq", "32",
                       "--precision", "fp32", "--gpu-mem", "4GiB", "--host-mem", "8GiB")
    assert code == 0
    assert "activations saved for backward:" in out
    assert "FSDP2, no reshard" in out and "ZeRO-3 + params, optimizer on NVMe" in out
    assert "recommendation: DDP without checkpointing" in out
    assert 'annot.auto_wrap(model, "ddp", checkpoint=False)' in out


@pytest.mark.slow
def test_plan_memory_json(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--memory", "--json", "--batch", "2", "--seq", "16",
                       "--gpu-mem", "100KiB", "--host-mem", "1GiB")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"plan", "memory", "notes"} and data["notes"] == []
    memory = data["memory"]
    assert memory["activations"]["saved"] > memory["activations"]["saved_checkpointed"] > 0
    assert {r["key"] for r in memory["rows"]} >= {"ddp", "zero2", "zero3", "fsdp2", "fsdp2-offload", "zero3-offload-opt"}
    assert memory["recommendation"] is None and memory["reason"].startswith("nothing fits")


@pytest.mark.slow
def test_plan_memory_says_expert_parallelism_is_not_priced(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--memory", "--gpus", "2", "--parallel", "ep=2",
                       "--kwargs", '{"n_layer": 2}', "--batch", "1", "--seq", "16")
    assert code == 0
    assert "experts over ep 2" in out
    assert "note: expert parallelism (ep=2) is not priced" in out.splitlines()[-1]


def test_plan_memory_bad_size_is_one_line(capsys):
    code, out, err = run(capsys, "plan", GPT, "--memory", "--gpu-mem", "lots")
    assert code == 2 and out == ""
    assert err == "annot plan: error: --gpu-mem: not a size: 'lots' (try 80GiB, 40G or 8e10)\n"


@pytest.mark.parametrize("flag,value", [("--inter-node-bw", "0"), ("--intra-node-bw", "-3"),
                                        ("--tflops", "nan"), ("--inter-node-bw", "inf")])
def test_plan_memory_bad_network_is_one_line(capsys, flag, value):
    code, out, err = run(capsys, "plan", GPT, "--memory", flag, value)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"{flag} must be a positive number" in err


def test_plan_memory_network_flag_not_a_number_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", GPT, "--memory", "--inter-node-bw", "fast"])
    assert info.value.code == 2
    assert "--inter-node-bw: invalid float value: 'fast'" in capsys.readouterr().err


def test_plan_memory_on_two_nodes_prints_traffic_and_step_time(capsys):
    code, out, _ = run(capsys, "plan", GPT, "--kwargs", '{"n_layer": 2, "n_embd": 64, "n_head": 4}',
                       "--memory", "--gpus-per-node", "4", "--nodes", "2", "--batch", "1", "--seq", "32",
                       "--gpu-mem", "80GiB", "--host-mem", "64GiB", "--inter-node-bw", "1", "--tflops", "100")
    assert code == 0
    assert "1 GB/s per node across nodes, 100 TFLOP/s per GPU" in out
    assert "across nodes" in out and "FSDP2 HSDP (2 x 4)" in out and "TP 4 x FSDP2 2" in out
    assert "the inter-node link binds" in out


def test_memory_cp_sizes_that_are_not_integers_are_refused(capsys):
    code, _, err = run(capsys, "plan", GPT, "--memory", "--cp", "2,x")
    assert code == 2
    assert "--cp '2,x': give sizes as integers" in err


def _fp32_model(name: str, why: str, tail: str) -> str:
    """The source of a model whose forward mixes its (parameter-dtype) hidden states
    ``h`` with an fp32 tensor it makes, in ``tail``."""
    return ("import torch\nfrom torch import nn\nimport annot\n\n"
            "@annot.shard_block\nclass Block(nn.Linear):\n    pass\n\n"
            f"class {name}(nn.Module):\n    # {why}\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.embed, self.block = nn.Embedding(11, 8), Block(8, 8)\n\n"
            "    def forward(self, input_ids=None):\n"
            "        h = self.block(self.embed(input_ids))\n" + tail)


# As xLSTM's chunked kernel: torch refuses it with 16-bit parameters, runs it under autocast.
_FP32_GATE = _fp32_model("Fp32Gate", "multiplies by an fp32 tensor",
                         "        return (h[None] @ torch.ones(1, 1, 8, 8, dtype=torch.float32)).float().sum()\n")


def test_plan_memory_plans_a_model_that_fails_in_16_bit_with_amp_and_says_so(capsys, tmp_path):
    source = tmp_path / "gate.py"
    source.write_text(_FP32_GATE)
    code, out, _ = run(capsys, "plan", f"{source}:Fp32Gate", "--memory", "--seq", "8")
    assert code == 0
    assert "Memory for Fp32Gate" in out and ", amp, adamw;" in out
    note = out.splitlines()[-1]
    assert note.startswith("note: Fp32Gate.forward fails with 16-bit parameters (RuntimeError:")
    assert "planned with --precision amp" in note


def test_plan_memory_refuses_a_16_bit_precision_the_model_fails_with_when_it_is_asked_for(capsys, tmp_path):
    source = tmp_path / "gate.py"
    source.write_text(_FP32_GATE)
    code, out, err = run(capsys, "plan", f"{source}:Fp32Gate", "--memory", "--seq", "8",
                         "--precision", "bf16-mixed")
    assert code == 2 and out == ""
    assert "--precision bf16-mixed traces the forward with 16-bit parameters" in err


# As Cosmos-3-Omni's scatter: fails with 16-bit parameters and under bf16 autocast alike.
_FP32_BUFFER = _fp32_model("Fp32Buffer", "copies into an fp32 buffer",
                           "        h = h.reshape(-1, 8)\n"
                           "        out = torch.zeros(h.shape, dtype=torch.float32)\n"
                           "        return out.scatter(0, torch.zeros(h.shape, dtype=torch.long), h).sum()\n")


def test_plan_memory_plans_a_model_that_fails_under_autocast_too_in_fp32_and_says_so(capsys, tmp_path):
    source = tmp_path / "buffer.py"
    source.write_text(_FP32_BUFFER)
    code, out, err = run(capsys, "plan", f"{source}:Fp32Buffer", "--memory", "--seq", "8")
    assert code == 0, err
    assert ", fp32, adamw;" in out
    note = out.splitlines()[-1]
    assert "planned with --precision fp32 instead (it fails under bf16 autocast too)" in note


# A model whose config says 512 positions but whose forward reaches only 300 tokens (as
# ProphetNet's n-gram streams take positions beyond the ones it is given).
_SHORT_REACH = (
    "import types\n"
    "import torch\n"
    "from torch import nn\n"
    "class ShortReach(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.config = types.SimpleNamespace(max_position_embeddings=512)\n"
    "        self.embed = nn.Embedding(16, 8)\n"
    "        self.block = nn.Linear(8, 8)\n"
    "    def forward(self, input_ids=None):\n"
    "        if input_ids.shape[1] > 300:\n"
    "            raise RuntimeError('positions beyond the table')\n"
    "        return self.block(self.embed(input_ids)).sum()\n")


def _plan_short_reach(capsys, tmp_path, *options: str):
    source = tmp_path / "reach.py"
    source.write_text(_SHORT_REACH)
    return run(capsys, "plan", f"{source}:ShortReach", "--policy", "name:block", "--memory", *options)


def test_plan_memory_traces_a_shorter_default_seq_where_the_model_cannot_reach_its_own(capsys, tmp_path):
    code, out, _ = _plan_short_reach(capsys, tmp_path)
    assert code == 0, out
    note = out.splitlines()[-1]
    assert note.startswith("note: traced at --seq 256: ShortReach.forward fails at the default 512")
    assert "batch 1 x seq 256 per GPU" in out


def test_plan_memory_given_seq_the_model_cannot_reach_is_an_error_not_a_fallback(capsys, tmp_path):
    code, out, err = _plan_short_reach(capsys, tmp_path, "--seq", "400")
    assert code == 2 and out == "" and "positions beyond the table" in err
