"""Worker: architectures whose unit choice used to break FSDP2 (tests/huggingface/
test_unit_choice.py), trained one step with ``auto_wrap(model, "fsdp2")`` on every rank's
half of a batch and compared with the untouched model on the whole batch in one process.

    torchrun --nproc_per_node 2 tests/huggingface/unit_choice_worker.py OUT ARCH [ARCH ...]
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CONFIGS = {
    # Two tied groups, the bias group split by grouping the weight's (fixed order-free).
    "camembert": dict(SIZES, **NO_DROPOUT, num_hidden_layers=2, is_decoder=True),
    "xlm-roberta": dict(SIZES, **NO_DROPOUT, num_hidden_layers=2, is_decoder=True),
    # _no_split_modules names only the attention: the layer is the unit.
    "roberta-prelayernorm": dict(SIZES, **NO_DROPOUT, num_hidden_layers=2, is_decoder=True),
    # One shared attention block at layers 2 and 7 (tied parameters in two layers).
    "zamba": dict(SIZES, num_hidden_layers=12, num_key_value_heads=4, attention_hidden_size=128,
                  attention_head_dim=32, mamba_d_state=8, mamba_dt_rank=8, n_mamba_heads=2),
}


def _model(arch: str) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(arch, **CONFIGS[arch])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def run(*archs: str) -> dict[str, dict[str, float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for arch in archs:
        reference = _model(arch)
        model = copy.deepcopy(reference)
        ids = torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(1))
        reference.train()
        expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
        expected.backward()
        trainer = annot.auto_wrap(model, "fsdp2", device="cpu",
                                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        rows = ids[2 * rank: 2 * rank + 2]
        loss = trainer(input_ids=rows, labels=rows).loss
        trainer.backward(loss)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        grads = dict(reference.named_parameters())
        worst = 0.0
        for name, param in trainer.module.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            worst = max(worst, (grad - grads[name].grad).abs().max().item())
        results[arch] = {"loss": mean.item() / world, "expected": expected.item(), "grad": worst}
    return results


if __name__ == "__main__":
    worker_main(run)
