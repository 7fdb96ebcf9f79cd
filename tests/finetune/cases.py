"""Fine-tuning cases shared by the 2-rank worker and the single-process reference:
a PEFT LoRA Llama (fp32, and on a bf16 base with fp32 adapters), a Llama with frozen
embeddings, a T5 with a frozen encoder tower.

Each is built from the same seed in every process; the reference trains the unwrapped
model on the union of the ranks' rows (`tests.huggingface.hf_archs.batches`), so the
mean of the ranks' losses and the averaged gradients are the reference's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.huggingface.hf_archs import ARCHS, SEED, batches

# engine scenario -> (engine, auto_wrap options)
ENGINES: dict[str, tuple[str, dict]] = {
    "fsdp2": ("fsdp2", {}),
    "fsdp2-offload": ("fsdp2", {"offload": True}),
    "fsdp1": ("fsdp1", {}),
    "zero2": ("deepspeed", {"stage": 2}),
    "zero3": ("deepspeed", {"stage": 3}),
}
# fp32, SGD with momentum: what is left is the order of float additions in reductions.
TOLERANCE = 1e-6


def LORA():  # noqa: N802 (a config factory, named as the constant it stands for)
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def lora_llama() -> nn.Module:
    import peft

    base = ARCHS["llama"].build()
    torch.manual_seed(SEED + 1)  # LoRA's A matrices are drawn here, the same everywhere
    return peft.get_peft_model(base, LORA())


def lora_bf16_llama() -> nn.Module:
    """LoRA on a bf16 base: PEFT keeps the adapters in fp32 (``autocast_adapter_dtype``),
    so each decoder layer holds frozen bf16 weights beside trainable fp32 ones."""
    import peft

    base = ARCHS["llama"].build().to(torch.bfloat16)
    torch.manual_seed(SEED + 1)
    return peft.get_peft_model(base, LORA())


def llama_frozen_embeddings() -> nn.Module:
    model = ARCHS["llama"].build()
    model.model.embed_tokens.requires_grad_(False)
    return model


def t5_frozen_encoder() -> nn.Module:
    model = ARCHS["t5"].build()
    model.encoder.requires_grad_(False)  # the encoder tower, with the shared embedding
    return model


CASES: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "lora": ("llama", lora_llama),
    "lora-bf16": ("llama", lora_bf16_llama),
    "frozen-embeddings": ("llama", llama_frozen_embeddings),
    "frozen-encoder": ("t5", t5_frozen_encoder),
}


# Runs not launched: FSDP1 refuses LoRA on a bf16 base at auto_wrap, before any process
# group (a FlatParameter has one dtype; tests/engines/test_dtype_mixes.py). Its FSDP2 CPU
# offload and ZeRO-2 runs are left out for suite time: ZeRO-2 keeps frozen parameters whole
# and outside its optimizer, so the bf16 weights never reach its flat buffers or gradient
# reduction (ZeRO-3 partitions and gathers them); both matched one process when run by hand.
NOT_LAUNCHED = {"lora-bf16:fsdp1", "lora-bf16:fsdp2-offload", "lora-bf16:zero2"}


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def pretrained_lora(directory: str, engine: str | None, **options):
    """``annot.from_pretrained`` of the saved base Llama with the LoRA config, from the
    same seed in every process (the adapters' random numbers)."""
    import annot

    torch.manual_seed(SEED + 2)
    return annot.from_pretrained(directory, engine, peft_config=LORA(), **options)


def reference_pretrained(directory: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`pretrained_lora` trained in one process on the union of the ranks' rows."""
    model = pretrained_lora(directory, None).train()
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches("llama"):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, trainable(model)


def reference(case: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, trainable parameters after training and frozen ones, in one process."""
    arch, build = CASES[case]
    model = build()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches(arch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, trainable(model), frozen
