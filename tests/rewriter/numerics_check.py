"""Run original and rewritten models side by side; print what the tests assert on, as JSON.

Run as a module from the repository root (``python -m tests.rewriter.numerics_check
--target deepspeed``) so that DeepSpeed's
module-level state and its slow import stay out of the pytest process.
For each model: the largest loss and gradient differences in training, the state_dict
keys, and how many checkpoint calls one forward makes in train mode, eval mode and
under ``torch.no_grad()``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from annot.rewriter import marked_classes, rewrite_source

REPO = Path(__file__).resolve().parents[2]

# Call shapes the two real models do not have: a 1-tuple result indexed later or at once,
# keyword tensors named like torch checkpoint's own options, tuple targets, a Sequential.
SHAPES = """\
import torch
from torch import nn

from annot import checkpoint_block


@checkpoint_block
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None, use_reentrant=None, preserve_rng_state=None, **kwargs):
        y = torch.tanh(self.lin(x))
        if scale is not None:
            y = y * scale
        if use_reentrant is not None:
            y = y + use_reentrant * preserve_rng_state
        return (y,)


@checkpoint_block
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, aux):
        return torch.tanh(self.lin(x)) + aux, aux * 0.5


@checkpoint_block
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.pairs = nn.ModuleList([Pair() for _ in range(2)])
        self.seq = nn.Sequential(*[Plain() for _ in range(2)])
        self.bias = nn.Parameter(torch.full((8,), 0.1))

    def forward(self, x):
        for layer in self.layers:
            outputs = layer(x, scale=2.0, use_reentrant=self.bias, preserve_rng_state=self.bias)
            x = outputs[0]
        for layer in self.layers:
            x = layer(x, None)[0]
        aux = x
        for pair in self.pairs:
            x, aux = pair(x, aux)
        x = self.seq(x)
        return (x + aux).pow(2).mean()
"""


def load_rewritten(
    path: Path, name: str, package: str | None, target: str, source: str | None = None
) -> types.ModuleType:
    """Exec the rewritten source of ``path`` as module ``name`` (relative imports resolve
    against ``package``, so a transformers file keeps importing the installed package)."""
    source = source if source is not None else path.read_text(encoding="utf-8")
    result = rewrite_source(source, target=target, blocks=marked_classes(source) or None)
    assert result.changed, f"nothing wrapped in {path}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__package__ = package
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(result.code, f"<rewritten {path.name}>", "exec"), module.__dict__)
    return module


def load_original(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def counting(target: str) -> Iterator[list[int]]:
    """Count calls of the checkpoint function the emitted code looks up at call time."""
    if target == "deepspeed":
        import deepspeed

        owner, attr = deepspeed.checkpointing, "non_reentrant_checkpoint"
    else:
        import torch.utils.checkpoint

        owner, attr = torch.utils.checkpoint, "checkpoint"
    real = getattr(owner, attr)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(owner, attr, counted)
    try:
        yield calls
    finally:
        setattr(owner, attr, real)


def compare(
    build: Callable[[types.ModuleType], torch.nn.Module],
    original: types.ModuleType,
    rewritten: types.ModuleType,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    target: str,
) -> dict[str, object]:
    torch.manual_seed(0)
    ref = build(original)
    new = build(rewritten)
    same_keys = list(ref.state_dict()) == list(new.state_dict())
    new.load_state_dict(ref.state_dict())
    ref.train()
    new.train()
    torch.manual_seed(1)
    ref_loss = loss_of(ref)
    ref_loss.backward()
    torch.manual_seed(1)
    with counting(target) as calls:
        new_loss = loss_of(new)
        new_loss.backward()
    train_calls = calls[0]
    ref_grads = dict(ref.named_parameters())
    grad_diff = 0.0
    missing = []
    for name, p in new.named_parameters():
        g_ref = ref_grads[name].grad
        if p.grad is None or g_ref is None:
            if (p.grad is None) != (g_ref is None):
                missing.append(name)
            continue
        grad_diff = max(grad_diff, (p.grad - g_ref).abs().max().item())
    new.eval()
    with counting(target) as calls:
        eval_loss = loss_of(new)
    eval_calls = calls[0]
    new.train()
    with counting(target) as calls, torch.no_grad():
        loss_of(new)
    no_grad_calls = calls[0]
    ref.eval()
    return {
        "loss_diff": abs(new_loss.item() - ref_loss.item()),
        "grad_diff": grad_diff,
        "grads_missing": missing,
        "n_grads": sum(p.grad is not None for p in new.parameters()),
        "same_state_dict_keys": same_keys,
        "train_calls": train_calls,
        "eval_calls": eval_calls,
        "no_grad_calls": no_grad_calls,
        "eval_loss_diff": abs(eval_loss.item() - loss_of(ref).item()),
    }


def gpt(target: str) -> dict[str, object]:
    path = REPO / "examples" / "gpt" / "model.py"
    original = load_original(path, "annot_test_gpt_original")
    rewritten = load_rewritten(path, f"annot_test_gpt_{target}", None, target)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.GPT(dropout=0.1, n_layer=3)

    return {**compare(build, original, rewritten, lambda m: m(idx, idx)[1], target), "layers": 3}


def llama(target: str) -> dict[str, object]:
    import transformers.models.llama.modeling_llama as original
    from transformers import LlamaConfig

    path = Path(original.__file__)
    rewritten = load_rewritten(
        path,
        f"transformers.models.llama.modeling_llama_annot_{target}",
        "transformers.models.llama",
        target,
    )
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.LlamaForCausalLM(config)

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    return {**compare(build, original, rewritten, loss_of, target), "layers": 2}


def shapes(target: str) -> dict[str, object]:
    path = Path("shapes.py")
    original = types.ModuleType("annot_test_shapes")
    exec(compile(SHAPES, "shapes.py", "exec"), original.__dict__)
    rewritten = load_rewritten(path, f"annot_test_shapes_{target}", None, target, SHAPES)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.Net()

    # 3 + 3 layers, 2 pairs, 2 Sequential elements
    return {**compare(build, original, rewritten, lambda m: m(x), target), "layers": 10}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=("deepspeed", "torch"), required=True)
    args = parser.parse_args()
    results = {"gpt": gpt(args.target), "llama": llama(args.target), "shapes": shapes(args.target)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
