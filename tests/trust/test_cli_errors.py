"""`annot plan` on bad input (issue #20): one line on stderr naming the input, exit
status 2, no traceback. In process, through the command's own `main`."""

from __future__ import annotations

import json
import re

import pytest

from annot.cli.main import main

transformers = pytest.importorskip("transformers")


def _hf_dir(tmp_path, **overrides):
    folder = tmp_path / "hf"
    transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **overrides}))
    return str(folder)


def _file(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# (id, argv builder, text the one line must contain)
CASES = [
    ("heads do not divide hidden (--kwargs)",
     lambda t: ["hf:llama", "--kwargs", '{"hidden_size": 30, "num_attention_heads": 4}'],
     "hf:llama: .*not a multiple of the number of attention heads"),
    ("heads do not divide hidden (config.json)",
     lambda t: [_hf_dir(t, hidden_size=30, num_attention_heads=4)], "hf: .*not a multiple"),
    ("a config value of the wrong type", lambda t: ["hf:llama", "--kwargs", '{"vocab_size": "x"}'],
     "field 'vocab_size'"),
    ("--config not UTF-8", lambda t: ["hf:llama", "--config", _file(t, "c.json", b"\xff\xfe{}")],
     r"--config .*c.json: not UTF-8"),
    ("--config bad JSON", lambda t: ["hf:llama", "--config", _file(t, "c.json", b"{oops")],
     r"--config .*c.json: bad JSON"),
    ("--config a list", lambda t: ["hf:llama", "--config", _file(t, "c.json", b"[1]")],
     r"--config .*c.json: expected a mapping"),
    ("--config missing", lambda t: ["hf:llama", "--config", str(t / "none.json")], "none.json: no such file"),
    ("--kwargs bad JSON", lambda t: ["hf:llama", "--kwargs", "{"], "--kwargs: bad JSON"),
    ("--kwargs a list", lambda t: ["hf:llama", "--kwargs", "[]"], "--kwargs: expected a JSON object"),
    ("unknown model type", lambda t: ["hf:nosuchmodel"], "hf:nosuchmodel: unknown transformers model type"),
    ("missing file target", lambda t: [str(t / "nosuch.py") + ":Model"], "nosuch.py: no such file"),
    ("missing class", lambda t: ["examples/gpt/model.py:Nope"], "no class Nope"),
    ("a bad rule", lambda t: ["hf:llama", "--policy", "bogus("], "in rule 'bogus\\('"),
    ("a bad size", lambda t: ["hf:llama", "--gpu-mem", "lots"], "--gpu-mem: not a size"),
    ("batch zero", lambda t: ["hf:llama", "--memory", "--batch", "0"], "--batch must be at least 1"),
    ("gpus zero", lambda t: ["hf:llama", "--memory", "--gpus", "0"], "--gpus and --nodes must be at least 1"),
    ("a folder without config.json", lambda t: [str(t)], "directory has no config.json"),
]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    status = main(["plan", *argv(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("annot plan: error: "), err
    assert "Traceback" not in err
    assert re.search(message, lines[0]), lines[0]
