"""Run original and rewritten models side by side; print what the tests assert on, as JSON.

Run as a module from the repository root (``python -m tests.rewriter.numerics_check
--target deepspeed``) so that DeepSpeed's
module-level state and its slow import stay out of the pytest process.
For each model: the largest loss and gradient differences in training, the state_dict
keys, how many checkpoint calls one forward makes in train mode, eval mode and under
``torch.no_grad()``, and how many block forwards a training step runs more than the
original (the recomputations).
``--partition`` first configures DeepSpeed's checkpointing with ``partition_activations``
and ``cpu_checkpointing`` on a one-process gloo group (DeepSpeed reads its rank).
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
DATA = Path(__file__).resolve().parent / "data"

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
    path: Path,
    name: str,
    package: str | None,
    target: str,
    source: str | None = None,
    blocks: frozenset[str] | None = None,
) -> types.ModuleType:
    """Exec the rewritten source of ``path`` as module ``name`` (relative imports resolve
    against ``package``, so a transformers file keeps importing the installed package)."""
    source = source if source is not None else path.read_text(encoding="utf-8")
    blocks = blocks or marked_classes(source) or None
    result = rewrite_source(source, target=target, blocks=blocks)
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
        import torch.utils.checkpoint as torch_checkpoint

        owner, attr = torch_checkpoint, "checkpoint"
    real = getattr(owner, attr)
    calls = [0, 0]  # checkpoint calls, tensors handed to the checkpoint function itself

    def counted(*args, **kwargs):
        calls[0] += 1
        calls[1] += sum(torch.is_tensor(a) for a in args[1:])
        return real(*args, **kwargs)

    setattr(owner, attr, counted)
    try:
        yield calls
    finally:
        setattr(owner, attr, real)


@contextlib.contextmanager
def block_forwards(model: torch.nn.Module, classes: set[str]) -> Iterator[list[int]]:
    """Count forward calls of the model's modules whose class is in ``classes``."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    handles = [
        m.register_forward_pre_hook(hook) for m in model.modules() if type(m).__name__ in classes
    ]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def compare(
    build: Callable[[types.ModuleType], torch.nn.Module],
    original: types.ModuleType,
    rewritten: types.ModuleType,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    target: str,
    blocks: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, object]:
    torch.manual_seed(0)
    ref = build(original)
    new = build(rewritten)
    same_keys = list(ref.state_dict()) == list(new.state_dict())
    new.load_state_dict(ref.state_dict())
    ref.train()
    new.train()
    torch.manual_seed(1)
    with block_forwards(ref, blocks) as ref_forwards:
        ref_loss = loss_of(ref)
        ref_loss.backward()
    torch.manual_seed(1)
    with counting(target) as calls, block_forwards(new, blocks) as new_forwards:
        new_loss = loss_of(new)
        new_loss.backward()
    train_calls, streamed = calls
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
        "recomputed": new_forwards[0] - ref_forwards[0],
        "streamed": streamed,
    }


def gpt(target: str) -> dict[str, object]:
    path = REPO / "examples" / "gpt" / "model.py"
    original = load_original(path, "annot_test_gpt_original")
    rewritten = load_rewritten(path, f"annot_test_gpt_{target}", None, target)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.GPT(dropout=0.1, n_layer=3)

    r = compare(build, original, rewritten, lambda m: m(idx, idx)[1], target, {"Block"})
    return {**r, "layers": 3}


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

    r = compare(build, original, rewritten, loss_of, target, {"LlamaDecoderLayer"})
    return {**r, "layers": 2}


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
    blocks = {"Layer", "Pair", "Plain"}
    return {**compare(build, original, rewritten, lambda m: m(x), target, blocks), "layers": 10}


# The x-transformers shape (a dynamic position-bias MLP fed from `arange`: no tensor input
# needs grad) plus the trunk shapes of issue 15, written here: a ModuleDict trunk filled
# by key and iterated by `.values()` whose blocks share a rotary table and a mask, pairs
# unpacked by `for attn, ff in self.layers` with residual adds, the trunk loop in
# `forward_features`, an expert loop inside the blocks (outermost trunk wins), dropout.
SHAPES_15 = """\
import torch
from torch import nn


class PosBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, pos):
        return torch.nn.functional.silu(self.lin(pos))


class PositionBias(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.first = nn.Linear(1, 8)
        self.mlp = nn.ModuleList([PosBlock(8) for _ in range(depth)])  # a trunk of its own

    def forward(self, n):
        pos = self.first(torch.arange(n).float()[:, None]).detach()
        for layer in self.mlp:
            pos = layer(pos)
        return pos


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.qkv = nn.Linear(8, 8)
        self.experts = nn.ModuleList([Expert() for _ in range(2)])
        self.drop = nn.Dropout(p)

    def forward(self, h, mask, freqs):
        a = self.qkv(h) * freqs
        a = a.masked_fill(mask, 0.0)
        out = h + self.drop(a)
        for expert in self.experts:
            out = out + expert(out)
        return out


class Attention(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x)))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self, n_layers, p):
        super().__init__()
        self.bias = PositionBias(2)
        self.layers = nn.ModuleDict()
        for i in range(n_layers):
            self.layers[str(i)] = Block(p)
        self.pairs = nn.ModuleList([])
        for _ in range(2):
            self.pairs.append(nn.ModuleList([Attention(p), FeedForward()]))
        self.register_buffer("freqs", torch.linspace(0.5, 1.5, 8))

    def forward_features(self, x):
        mask = x > 1.5
        h = x + self.bias(x.shape[0])
        for layer in self.layers.values():
            h = layer(h, mask, self.freqs)
        for attn, ff in self.pairs:
            h = attn(h) + h
            h = ff(h) + h
        return h

    def forward(self, x):
        return self.forward_features(x).pow(2).mean()
"""


def position_bias(target: str) -> dict[str, object]:
    """The x-transformers shape, wrapped on request (`--blocks PosBlock`)."""
    original = types.ModuleType("annot_test_shapes15")
    exec(compile(SHAPES_15, "shapes15.py", "exec"), original.__dict__)
    blocks = frozenset({"PosBlock"})
    rewritten = load_rewritten(
        Path("shapes15.py"), f"annot_test_posbias_{target}", None, target, SHAPES_15, blocks
    )

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.PositionBias(3)

    r = compare(build, original, rewritten, lambda m: m(6).pow(2).sum(), target, set(blocks))
    return {**r, "layers": 3}


def shapes_15(target: str, p: float) -> dict[str, object]:
    """Trunk selection on the issue-15 shapes: 2 position-bias blocks, 3 ModuleDict
    blocks, 2 x (attn, ff); the experts inside the blocks are not wrapped again."""
    original = types.ModuleType("annot_test_shapes15")
    exec(compile(SHAPES_15, "shapes15.py", "exec"), original.__dict__)
    rewritten = load_rewritten(
        Path("shapes15.py"), f"annot_test_shapes15_{target}_{p}", None, target, SHAPES_15
    )
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.Net(3, p)

    blocks = {"PosBlock", "Block", "Attention", "FeedForward"}
    return {**compare(build, original, rewritten, lambda m: m(x), target, blocks), "layers": 9}


def nanogpt(target: str, dropout: float) -> dict[str, object]:
    """karpathy/nanoGPT's model.py as published (tests/rewriter/data, header)."""
    path = DATA / "nanogpt_model.py"
    original = load_original(path, "annot_test_nanogpt_original")
    rewritten = load_rewritten(path, f"annot_test_nanogpt_{target}_{dropout}", None, target)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(6))

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        config = m.GPTConfig(block_size=16, vocab_size=64, n_layer=3, n_head=2, n_embd=16,
                             dropout=dropout)
        return m.GPT(config)

    r = compare(build, original, rewritten, lambda m: m(idx, idx)[1], target, {"Block"})
    return {**r, "layers": 3}


def vit(target: str) -> dict[str, object]:
    """lucidrains/vit-pytorch's vit.py as published: `for attn, ff in self.layers`."""
    try:
        import einops  # noqa: F401
    except ImportError:
        return {"skipped": "einops is not installed"}
    path = DATA / "vit_pytorch_vit.py"
    original = load_original(path, "annot_test_vit_original")
    rewritten = load_rewritten(path, f"annot_test_vit_{target}", None, target)
    img = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(7))

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return m.ViT(image_size=8, patch_size=4, num_classes=5, dim=16, depth=2, heads=2,
                     mlp_dim=16, dim_head=8, dropout=0.1, emb_dropout=0.1)

    blocks = {"Attention", "FeedForward"}
    r = compare(build, original, rewritten, lambda m: m(img).pow(2).mean(), target, blocks)
    return {**r, "layers": 4}


def _hf(target: str, name: str, config: object, classes: set[str]) -> dict[str, object]:
    """A transformers causal LM built from ``config``: numbers, checkpoint calls and the KV
    cache's length after one training step (a recomputation would add the keys again)."""
    import importlib

    original = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    path = Path(original.__file__)
    rewritten = load_rewritten(
        path,
        f"transformers.models.{name}.modeling_{name}_annot_{target}",
        f"transformers.models.{name}",
        target,
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    cls = next(n for n in dir(original) if n.endswith("LMHeadModel") or n.endswith("ForCausalLM"))
    caches: dict[int, int] = {}

    def build(m: types.ModuleType) -> torch.nn.Module:
        torch.manual_seed(0)
        return getattr(m, cls)(config)

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        out = model(input_ids=ids, labels=ids)
        cache = out.past_key_values
        caches[id(model)] = cache.get_seq_length() if cache is not None else -1
        return out.loss

    r = compare(build, original, rewritten, loss_of, target, classes)
    return {**r, "cache_lengths": sorted(set(caches.values())), "layers": 2}


def llama_cache(target: str, use_cache: bool) -> dict[str, object]:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=use_cache)
    config._attn_implementation = "eager"
    return _hf(target, "llama", config, {"LlamaDecoderLayer"})


def gpt2_cache(target: str, use_cache: bool) -> dict[str, object]:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        use_cache=use_cache)
    config._attn_implementation = "eager"
    return _hf(target, "gpt2", config, {"GPT2Block"})


def _partitioning() -> None:
    """DeepSpeed's checkpointing with partitioned activations and CPU checkpointing, as a
    user's config would turn on; DeepSpeed needs a process group to read the rank from."""
    import os

    import deepspeed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=("deepspeed", "torch"), required=True)
    parser.add_argument("--partition", action="store_true")
    args = parser.parse_args()
    t = args.target
    if args.partition:
        _partitioning()
        results = {
            "shapes15": shapes_15(t, 0.1),
            "nanogpt": nanogpt(t, 0.1),
            "llama": llama(t),
            "posbias": position_bias(t),
        }
    else:
        results = {
            "gpt": gpt(t),
            "llama": llama(t),
            "shapes": shapes(t),
            "posbias": position_bias(t),
            "shapes15": shapes_15(t, 0.1),
            "shapes15_nodrop": shapes_15(t, 0.0),
            "nanogpt": nanogpt(t, 0.1),
            "nanogpt_nodrop": nanogpt(t, 0.0),
            "vit": vit(t),
            "llama_cache": llama_cache(t, True),
            "llama_nocache": llama_cache(t, False),
            "gpt2_cache": gpt2_cache(t, True),
            "gpt2_nocache": gpt2_cache(t, False),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
