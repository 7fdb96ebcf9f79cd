"""Run under torchrun (4 ranks) by test_tensor_parallel.py: tensor parallel 2 x FSDP2 2.

    python -m torch.distributed.run --nproc_per_node 4 tensor_parallel_worker.py OUT SCRATCH NAME...

Scenarios (`tests.engines.tensor_parallel_cases`), for NAME in ``llama``, ``gpt``:

- ``train:NAME``: auto_wrap with the ``("shard", "tp")`` mesh and an optimizer, train
  STEPS steps on this data-parallel group's rows; record the global loss and every
  gradient (whole) at every step, the final parameters, the placements, and save the
  result twice: ``annot.save`` (safetensors) and ``annot.save_state``, then load the
  state into a fresh wrapped model and compare parameters and momentum buffers;
- ``meta:NAME``: build under ``annot.meta_init``, auto_wrap (materialized shard by shard):
  every parameter whole and this rank's own block, against the eager build;
- ``load:NAME``: the same meta build, then ``annot.load`` of SCRATCH/NAME-weights (a
  different seed's weights, saved by the test): values against that model and the bytes
  this rank read against the bytes it keeps;
- ``pretrained:llama``: ``annot.from_pretrained`` of the same weights with the mesh;
- ``mapped:llama``: the same with ``mmap=True``, and which parameters were not mapped
  (on any rank) against those whose block on some rank is not whole rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import annot
from annot.meta.layout import dtensor_block
from tests.distributed import gathered, worker_main
from tests.engines.tensor_parallel_cases import (
    DP,
    STEPS,
    TP,
    batches,
    build,
    group_rows,
    loss_fn,
    make_optimizer,
    tp_plan,
)
from tests.mapped_files import not_mapped


def mesh():  # noqa: ANN201 (a DeviceMesh; the type is torch's)
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("shard", "tp"))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: all ranks call it in the same order)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def wrapped(name: str, model: torch.nn.Module, **options) -> annot.Trainable:
    return annot.auto_wrap(model, "fsdp2", mesh=mesh(), tp_plan=tp_plan(name),
                           optimizer=make_optimizer, **options)


def train(name: str, scratch: Path) -> dict:
    trainer = wrapped(name, build(name))
    group = dist.get_rank() // TP
    losses, grads = [], []
    for batch in batches(name):
        loss = loss_fn(name)(trainer, group_rows(batch, group))
        trainer.backward(loss)
        grads.append({n: full(p.grad) for n, p in trainer.model.named_parameters()})
        trainer.step()
        trainer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each group's loss counted TP times
        losses.append(total.item() / dist.get_world_size())
    params = {n: full(p) for n, p in trainer.model.named_parameters()}
    placements = {n: [repr(x) for x in p.placements] for n, p in trainer.model.named_parameters()}

    saved = scratch / f"{name}-saved"
    annot.save(trainer, saved)
    state = annot.save_state(scratch / f"{name}-state", trainer, step=STEPS)
    fresh = wrapped(name, build(name, seed=7))
    annot.load_state(state, fresh)
    mismatched = [n for n, p in fresh.model.named_parameters() if not torch.equal(full(p), params[n])]
    before = {n: trainer.optimizer.state[p]["momentum_buffer"] for n, p in trainer.model.named_parameters()}
    after = {n: fresh.optimizer.state[p]["momentum_buffer"] for n, p in fresh.model.named_parameters()}
    momentum = [n for n in before if not torch.equal(full(before[n]), full(after[n]))]
    return {"losses": losses, "grads": grads, "params": params, "placements": placements,
            "saved": str(saved), "state_params_mismatched": mismatched,
            "state_momentum_mismatched": momentum}


def own_blocks(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """Parameters whose local part is not exactly ``expected``'s block (every rank checks
    its own; the names of the failures are gathered)."""
    wrong = []
    for n, p in model.named_parameters():
        block = dtensor_block(p)
        want = expected[n][block.slices()] if block is not None else expected[n]
        if not torch.equal(p.to_local() if isinstance(p, DTensor) else p, want):
            wrong.append(n)
    return sorted({n for names in gathered(wrong) for n in names})


def meta(name: str, scratch: Path) -> dict:
    eager = {n: p.detach().clone() for n, p in build(name).named_parameters()}
    with annot.meta_init():
        model = build(name)
    trainer = wrapped(name, model)
    mismatched = [n for n, p in trainer.model.named_parameters() if not torch.equal(full(p), eager[n])]
    return {"mismatched": mismatched, "own_blocks_wrong": own_blocks(trainer.model, eager),
            "names": sorted(eager)}


def load(name: str, scratch: Path) -> dict:
    source = build(name, seed=1)  # the weights the test saved
    expected = {n: p.detach().clone() for n, p in source.named_parameters()}
    with annot.meta_init():
        model = build(name)
    trainer = wrapped(name, model)
    report = annot.load(trainer.module, scratch / f"{name}-weights")
    kept = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes
               for t in {id(p): p for p in trainer.model.parameters()}.values())
    read = gathered((report.bytes_read, kept))
    mismatched = [n for n, p in trainer.model.named_parameters() if not torch.equal(full(p), expected[n])]
    return {"mismatched": mismatched, "own_blocks_wrong": own_blocks(trainer.model, expected),
            "read_and_kept": read, "names": sorted(expected)}


def pretrained(name: str, scratch: Path, mmap: bool = False) -> dict:
    """``annot.from_pretrained`` (Llama only): built on meta, split, sharded, then read
    (or mapped)."""
    expected = {n: p.detach().clone() for n, p in build(name, seed=1).named_parameters()}
    directory = scratch / f"{name}-weights"
    model = annot.from_pretrained(directory, "fsdp2", mesh=mesh(), mmap=mmap)
    mismatched = [n for n, p in model.named_parameters() if not torch.equal(full(p), expected[n])]
    out = {"mismatched": mismatched, "own_blocks_wrong": own_blocks(model, expected),
           "names": sorted(expected)}
    if mmap:
        columns = [n for n, p in model.named_parameters()
                   if not dtensor_block(p).rows_only(tuple(p.shape))]
        out["not_mapped"], out["column_blocks"] = (
            sorted(set().union(*gathered(names))) for names in (not_mapped(model, directory), columns))
    return out


SCENARIOS = {"train": train, "meta": meta, "load": load, "pretrained": pretrained,
             "mapped": lambda name, scratch: pretrained(name, scratch, mmap=True)}


def run(scratch: str, *names: str) -> dict[str, dict]:
    out = {}
    for name in names:
        kind, model = name.split(":")
        out[name] = SCENARIOS[kind](model, Path(scratch))
    return out


if __name__ == "__main__":
    worker_main(run)
