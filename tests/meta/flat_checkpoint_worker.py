"""Run by test_checkpoint_io_distributed.py under torchrun: build the example GPT under
meta_init and let `auto_wrap(engine, load_from=checkpoint)` allocate it unit by unit
(FSDP1, or DeepSpeed ZeRO-3) and load it, each rank reading the rows its shards cover.
Saves from rank 0 the gathered full parameters, buffers and each rank's bytes read; then
`annot.save`s the sharded model to ``saved-ENGINE`` beside SOURCE.

    torchrun ... flat_checkpoint_worker.py OUT SOURCE ENGINE [ENGINE ...]   (fsdp1, zero3)

Each engine in turn, in one launch; OUT holds one such record per engine."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import annot
import annot.checkpoint_io.loading
from examples.gpt.model import GPT
from tests.distributed import worker_main

SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)


def run_one(engine: str, source: str) -> dict:
    reports = []
    load = annot.checkpoint_io.loading.load
    annot.checkpoint_io.loading.load = lambda *a, **k: reports.append(load(*a, **k)) or reports[-1]
    try:
        return loaded(engine, source, reports)
    finally:
        annot.checkpoint_io.loading.load = load


def loaded(engine: str, source: str, reports: list) -> dict:
    with annot.meta_init():
        model = GPT(**SHAPE)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = trainer = annot.auto_wrap(model, "fsdp1", load_from=source)
        with FullyShardedDataParallel.summon_full_params(wrapped):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()}
    else:
        import deepspeed

        trainer = annot.auto_wrap(model, "deepspeed", config=annot.deepspeed_config(model, stage=3),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                        load_from=source)
        full = {}
        for name, param in model.named_parameters():  # one at a time (see zero3 worker)
            with deepspeed.zero.GatheredParameters([param]):
                full[name] = param.detach().clone()
    buffers = {n.replace("_fsdp_wrapped_module.", ""): b.clone() for n, b in model.named_buffers()}
    assert len(reports) == 1 and not reports[0].missing and not reports[0].unexpected, reports
    # Several files, so a save crosses from one file (its close and fsync) to the next.
    annot.save(trainer, Path(source).parent / f"saved-{engine}", max_shard_bytes=100_000)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reports[0].bytes_read)
    return {"params": full, "buffers": buffers, "bytes_read": gathered}


def run(source: str, *engines: str) -> dict[str, dict]:
    return {engine: run_one(engine, source) for engine in engines}


if __name__ == "__main__":
    worker_main(run)
