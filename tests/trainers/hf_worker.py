"""Run by torchrun (tests/trainers/test_hf_trainer.py): the HuggingFace Trainer with
annot's DeepSpeed config (``for_="hf"``) and annot's checkpointing
(``apply_checkpointing(engine="deepspeed")``) on a tiny Llama, 2 CPU ranks, ZeRO-2.

Returns the mean of the ranks' losses at every step and, computed on rank 0 alone after
training, a single-process reference on the union of the ranks' batches (the Trainer
shuffles, so the batches are recorded); plus the decoder layers' MLP calls per layer and
step (2: each checkpointed layer recomputed once in backward).
"""

from __future__ import annotations

import logging
import tempfile

import torch
import torch.distributed as dist

import annot
from tests.distributed import worker_main

STEPS, BATCH, LR = 3, 2, 0.05


def build():
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def run(stage: str) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    model = build()
    config = annot.deepspeed_config(model, stage=int(stage), for_="hf")
    checkpointed = annot.apply_checkpointing(model, engine="deepspeed", checkpoint=True)
    calls = [0]
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": row, "labels": row}
            for row in torch.randint(0, 128, (STEPS * BATCH * dist.get_world_size(), 16),
                                     generator=gen)]
    seen: list[tuple[torch.Tensor, float]] = []

    class Recording(transformers.Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            seen.append((inputs["input_ids"].detach().cpu(), loss.item()))
            return loss

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS,
            deepspeed=config, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
            max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
            disable_tqdm=True, logging_strategy="no")
        Recording(model=model, args=args, train_dataset=data).train()

    losses = torch.tensor([loss for _, loss in seen], dtype=torch.float64)
    dist.all_reduce(losses)
    batches: list = [None] * dist.get_world_size()
    dist.all_gather_object(batches, [ids for ids, _ in seen])
    reference = None
    if dist.get_rank() == 0:  # one process, the union of the ranks' rows at every step
        bare = build()
        optimizer = torch.optim.SGD(bare.parameters(), lr=LR)
        reference = []
        for step in range(STEPS):
            ids = torch.cat([b[step] for b in batches])
            loss = bare(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            reference.append(loss.item())
    return {"losses": (losses / dist.get_world_size()).tolist(), "reference": reference,
            "checkpointed": checkpointed, "config": config,
            "mlp_calls_per_layer_step": calls[0] / STEPS / len(model.model.layers)}


if __name__ == "__main__":
    worker_main(run)
