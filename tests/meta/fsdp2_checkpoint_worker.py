"""Run by test_checkpoint_io_distributed.py under torchrun: load a safetensors checkpoint
into an FSDP2-sharded meta_init GPT (each rank reading its own rows), save it back from
the shards, and round-trip a torch distributed checkpoint.

    torchrun ... fsdp2_checkpoint_worker.py OUT SOURCE DIR

writes DIR/saved and DIR/dcp; OUT gets each rank's record (bytes read, round trip, ties)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import annot
from examples.gpt.model import GPT
from tests.distributed import worker_main

SHAPE = dict(n_layer=3, n_embd=48, n_head=4, vocab_size=101, block_size=32)


def sharded_meta_gpt(mesh):
    with annot.meta_init():
        model = GPT(**SHAPE)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(source: str, out: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = sharded_meta_gpt(mesh)
    report = annot.load(model, source)
    before = _bytes_written()
    annot.save(model, Path(out) / "saved", max_shard_bytes=100_000)
    written = _bytes_written() - before
    dcp.save(model.state_dict(), checkpoint_id=str(Path(out) / "dcp"))
    other = sharded_meta_gpt(mesh)
    annot.load(other, Path(out) / "dcp", dcp=True)
    same = all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(model.parameters(), other.parameters(), strict=True))
    results = [None] * world
    dist.all_gather_object(results, {"rank": rank, "bytes_read": report.bytes_read, "dcp_same": same,
                                     "tied": model.lm_head.weight is model.transformer.wte.weight,
                                     "bytes_written": written})
    return results


def _bytes_written() -> int:
    """Bytes this process passed to write calls so far (``wchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


if __name__ == "__main__":
    worker_main(run)
