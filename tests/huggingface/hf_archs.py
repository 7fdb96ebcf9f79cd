"""The architecture matrix: a tiny config for each transformers family, its head, the
layer class its plan must pick, and a batch for its loss.

Shared by the tests (single process: plans, references, from_pretrained logits), their
fixtures (conftest.py) and ``hf_worker.py`` (under torchrun). Sizes are tiny so the whole matrix trains in seconds
on CPU; every dropout is 0 so a model in training mode (where checkpointing runs) is
deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.reference import train_reference

VOCAB = 128
SEQ = 8
STEPS = 3
WORLD_SIZE = 2
ROWS_PER_RANK = 2
SEED = 0
# fp32 everywhere; what is left is the order of float additions in gradient reductions.
TOLERANCE = 1e-5
# 2-rank from_pretrained checks: one with tied embeddings (gemma), one without (llama),
# one whose file names differ from the model's (gpt_neox), an encoder-decoder (t5).
PRETRAINED_DISTRIBUTED = ("llama", "gemma", "gpt_neox", "t5")
LAUNCH_TIMEOUT_S = 420

_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4)


@dataclasses.dataclass(frozen=True)
class Arch:
    """One row of the matrix."""

    config_class: str  # a transformers config class name
    options: dict[str, Any]
    model_class: str  # the head, as save_pretrained records it in `architectures`
    layer: str  # the block class the plan must shard
    kind: str = "causal"  # which batch: causal, masked, seq2seq, image

    def config(self) -> Any:
        import transformers

        config = getattr(transformers, self.config_class)(**self.options)
        for key, value in vars(config).items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(config, key, 0.0)
        return config

    def model_cls(self) -> type:
        import transformers

        return getattr(transformers, self.model_class)

    def build(self) -> torch.nn.Module:
        """The model from ``SEED``, eagerly, in training mode."""
        torch.manual_seed(SEED)
        return self.model_cls()(self.config()).train()


ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaConfig", dict(_DECODER, num_key_value_heads=2), "LlamaForCausalLM",
                  "LlamaDecoderLayer"),
    "mistral": Arch("MistralConfig", dict(_DECODER, num_key_value_heads=2), "MistralForCausalLM",
                    "MistralDecoderLayer"),
    "qwen2": Arch("Qwen2Config", dict(_DECODER, num_key_value_heads=2), "Qwen2ForCausalLM",
                  "Qwen2DecoderLayer"),
    "gemma": Arch("GemmaConfig", dict(_DECODER, num_key_value_heads=2, head_dim=8),
                  "GemmaForCausalLM", "GemmaDecoderLayer"),
    "phi": Arch("PhiConfig", dict(_DECODER), "PhiForCausalLM", "PhiDecoderLayer"),
    "gpt2": Arch("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                    bos_token_id=0, eos_token_id=0), "GPT2LMHeadModel", "GPT2Block"),
    "gpt_neox": Arch("GPTNeoXConfig", dict(_DECODER), "GPTNeoXForCausalLM", "GPTNeoXLayer"),
    "falcon": Arch("FalconConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4), "FalconForCausalLM",
                   "FalconDecoderLayer"),
    "opt": Arch("OPTConfig", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, word_embed_proj_dim=32,
                                  max_position_embeddings=64), "OPTForCausalLM", "OPTDecoderLayer"),
    "bloom": Arch("BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
                  "BloomForCausalLM", "BloomBlock"),
    "bert": Arch("BertConfig", dict(_DECODER, max_position_embeddings=64), "BertForMaskedLM",
                 "BertLayer", kind="masked"),
    "t5": Arch("T5Config", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0),
               "T5ForConditionalGeneration", "T5Block",
               kind="seq2seq"),
    "vit": Arch("ViTConfig", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_labels=5), "ViTForImageClassification", "ViTLayer",
                kind="image"),
}

_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
# Buffers computed in other ways than the matrix's: scaled rotary variants, newer families.
BUFFER_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "dynamic_rope": ("LlamaConfig", "LlamaForCausalLM", dict(_SMALL, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_SMALL, head_dim=8)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_SMALL, num_local_experts=2)),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(_SMALL, global_attn_every_n_layers=1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_SMALL, head_dim=8, sliding_window=16)),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(_SMALL, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[2.0] * 4,
        original_max_position_embeddings=32))),
}

# Layers each model holds: T5 has an encoder and a decoder stack.
LAYER_COUNT = {name: 4 if name == "t5" else 2 for name in ARCHS}


def buffer_variant(name: str) -> tuple[type, Any]:
    """The model class and config of ``BUFFER_VARIANTS[name]``."""
    import transformers

    config_class, model_class, options = BUFFER_VARIANTS[name]
    return getattr(transformers, model_class), getattr(transformers, config_class)(**options)


def batches(name: str) -> list[dict[str, torch.Tensor]]:
    """One batch per step, the union of all ranks' rows (rank r gets rows r*R:(r+1)*R)."""
    kind = ARCHS[name].kind
    gen = torch.Generator().manual_seed(1)
    rows = WORLD_SIZE * ROWS_PER_RANK
    out = []
    for _ in range(STEPS):
        if kind == "image":
            out.append(dict(pixel_values=torch.randn(rows, 3, 16, 16, generator=gen),
                            labels=torch.randint(0, 5, (rows,), generator=gen)))
            continue
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
        batch = dict(input_ids=ids, labels=ids.clone())
        if kind == "seq2seq":
            batch["labels"] = torch.randint(0, VOCAB, (rows, SEQ // 2), generator=gen)
        out.append(batch)
    return out


def rank_rows(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK] for k, v in batch.items()}


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_losses(name: str) -> list[float]:
    """The unwrapped model trained in one process on the union of the ranks' rows."""
    losses, _ = train_reference(ARCHS[name].build, batches(name), make_optimizer,
                                lambda model, batch: model(**batch).loss)
    return losses


def probe_inputs(name: str) -> dict[str, torch.Tensor]:
    """A fixed batch for comparing logits."""
    gen = torch.Generator().manual_seed(2)
    kind = ARCHS[name].kind
    if kind == "image":
        return dict(pixel_values=torch.randn(3, 3, 16, 16, generator=gen))
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    if kind == "seq2seq":
        return dict(input_ids=ids, decoder_input_ids=torch.randint(0, VOCAB, (3, 5), generator=gen))
    return dict(input_ids=ids)


def count_recomputation(model: torch.nn.Module, layer: str) -> Callable[[bool], int]:
    """Count forwards, during backward, of modules inside ``layer`` blocks: the
    recomputation of checkpointed blocks (the block's own hooks do not fire then, since
    recomputation calls its forward directly). Register before wrapping. Returns a switch:
    ``switch(True)`` when backward starts, ``switch(False)`` when it ends; each call
    returns the count so far."""
    state = {"backward": False, "count": 0}

    def hook(*_: object) -> None:
        state["count"] += state["backward"]

    for module in model.modules():
        if type(module).__name__ == layer:
            for inner in list(module.modules())[1:]:
                inner.register_forward_pre_hook(hook)

    def switch(on: bool) -> int:
        state["backward"] = on
        return state["count"]

    return switch


class PlantedPickle:
    """Unpickling this creates ``path``: planted as ``.metadata`` (a torch distributed
    checkpoint's pickle) beside every saved model, it shows whether anything read it
    (issue #20; docs/design.md, pitfall 17)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def planted_sentinel(saved_models: Any) -> Path:
    """The file a planted pickle creates if anything ever unpickles it (``saved_models``:
    the fixture's `SavedModels`)."""
    return saved_models.root / "PLANTED-PICKLE-RAN"
