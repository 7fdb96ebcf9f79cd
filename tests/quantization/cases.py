"""The QLoRA cases shared by the 2-rank worker and the single-process reference: a tiny
Llama whose block linears split into whole NF4 scale blocks on 2 ranks, LoRA on every
block linear with B drawn (not zero: every adapter moves the loss from the first step),
and the batches each step trains on (rank r of 2 takes rows 2r and 2r + 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SEED = 7
STEPS = 5
LR = 1e-3
TOLERANCE = 1e-6  # fp32: what is left is the order of additions in the reductions
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _counting(step: int) -> torch.Tensor:
    """4 sequences of 16 tokens, each the previous plus the sequence's stride: learnable,
    so the loss falls over the steps."""
    generator = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, 256, (4, 1), generator=generator)
    stride = torch.randint(1, 4, (4, 1), generator=generator)
    return (start + stride * torch.arange(16)) % 256


BATCHES = [_counting(step) for step in range(STEPS)]
#: The step before which the 2-rank worker saves a training state to resume from.
RESUME_AT = 3
#: Rows whose logits the exports are checked on.
PROBE = _counting(99)


def save_tiny_llama(folder: Path, *, moe: bool = False) -> Path:
    """A tiny Llama (or Qwen3-MoE, ``moe``) with trained-looking weights, saved in ``folder``."""
    import transformers

    if moe:
        config: Any = transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=4, num_experts_per_tok=2)
        cls: Any = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    return folder


def lora() -> Any:
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                           init_lora_weights=False)


def adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's gradient, whole (a sharded one gathered: a collective)."""
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def quantized_digest(model: torch.nn.Module) -> dict[str, tuple[int, int, float]]:
    """Per NF4 weight this rank holds (its rows, under FSDP2): the sums of its packed
    codes, its quantized scalers and its scale factors, keyed by the unwrapped name."""
    out = {}
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", param)
        if type(local).__name__ == "NF4Tensor":
            out[name.removeprefix("module.")] = (
                int(local.quantized_data.to(torch.int64).sum()),
                int(local.quantized_scalers.to(torch.int64).sum()),
                float(local.quantization_factor.double().sum()))
    return out
