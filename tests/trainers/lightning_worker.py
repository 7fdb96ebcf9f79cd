"""Run by torchrun (tests/trainers/test_lightning.py): Lightning's Trainer and Fabric with
annot's strategies on 2 CPU ranks, and the silent cases they replace.

Every scenario trains the example GPT of tests/engines/harness.py on the harness's data
(each rank its slice of a step's batch) and returns the mean of the ranks' losses at every
step, which the test compares with the harness's single-process reference. Checkpointed
blocks are counted by recomputation: calls of each block's MLP per training step (1
without checkpointing, 2 with).
"""

from __future__ import annotations

import logging
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import annot
from tests.distributed import worker_main
from tests.engines.harness import CONFIG, batches, make_model, make_optimizer, rank_slice

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


def mean_over_ranks(values: list[float]) -> list[float]:
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def fsdp_units(root: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in root.named_modules() if isinstance(m, FSDPModule)]


class MLPCalls:
    """Counts the calls of every block's MLP (forward and recomputation)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        for block in model.transformer.h:
            block.mlp.register_forward_pre_hook(self.count)

    def count(self, *_: object) -> None:
        self.calls += 1

    def per_block_and_step(self, steps: int) -> float:
        return self.calls / steps / CONFIG["n_layer"]


def rank_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank = dist.get_rank()
    return [(rank_slice(i, rank), rank_slice(t, rank)) for i, t in batches()]


def lit_module_class() -> type:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            idx, targets = batch
            _, loss = self.model(idx, targets)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

        def train_dataloader(self):
            # Each rank its own slice, in step order (no distributed sampler).
            return torch.utils.data.DataLoader(rank_batches(), batch_size=None)

    return Lit


def trainer(max_epochs: int, **strategy_options):
    import lightning as L

    from annot.lightning import Strategy

    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), max_epochs=max_epochs,
                     strategy=Strategy(**strategy_options), use_distributed_sampler=False,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0)


def trainer_fsdp2(tmp: str) -> dict:
    """Trainer: 3 steps with the Plan's checkpointing, a checkpoint saved by Lightning,
    then a fresh module resumed from it for 3 more steps (the data again)."""
    Lit = lit_module_class()
    first = trainer(1, checkpoint=None)
    lit = Lit()
    calls = MLPCalls(lit.model)
    first.fit(lit)
    units = fsdp_units(lit)
    path = os.path.join(tmp, "lightning.ckpt")
    first.save_checkpoint(path)
    recomputed = calls.per_block_and_step(len(lit.losses))

    second = trainer(2, checkpoint=None)
    resumed = Lit()
    second.fit(resumed, ckpt_path=path)
    return {"losses": mean_over_ranks(lit.losses + resumed.losses), "units": units,
            "mlp_calls_per_block_step": recomputed, "dcp_folder": os.path.isdir(path)}


def trainer_meta_init() -> dict:
    """Trainer: the LightningModule built under trainer.init_module(empty_init=True),
    which annot's strategy makes a meta_init build; no checkpointing."""
    Lit = lit_module_class()
    run = trainer(1, checkpoint=False)
    # Seeded outside the block too: meta_init replays from the RNG state at its entry
    # (make_model's own manual_seed(0) inside the block sets the same state).
    torch.manual_seed(0)
    with run.init_module(empty_init=True):
        lit = Lit()
    meta = all(p.is_meta for p in lit.parameters())
    calls = MLPCalls(lit.model)
    run.fit(lit)
    return {"losses": mean_over_ranks(lit.losses), "built_on_meta": meta,
            "mlp_calls_per_block_step": calls.per_block_and_step(len(lit.losses)),
            "units": fsdp_units(lit)}


def fabric_fsdp2(tmp: str) -> dict:
    """Fabric: a meta_init build (fabric.init_module(empty_init=True)), 3 steps with
    checkpointing, fabric.save, a fresh build loaded with fabric.load, 3 more steps."""
    import lightning as L

    from annot.lightning import FabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(),
                      strategy=FabricStrategy(checkpoint=True))
    fabric.launch()
    path = os.path.join(tmp, "fabric-ckpt")
    losses, out = [], {}
    for part in ("first", "resumed"):
        torch.manual_seed(0)  # as in trainer_meta_init
        with fabric.init_module(empty_init=True):
            model = make_model()
        if part == "first":
            out["built_on_meta"] = all(p.is_meta for p in model.parameters())
            calls = MLPCalls(model)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
        if part == "resumed":
            fabric.load(path, {"model": model, "optimizer": optimizer})
        for idx, targets in rank_batches():
            _, loss = model(idx, targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if part == "first":
            out["mlp_calls_per_block_step"] = calls.per_block_and_step(len(losses))
            out["units"] = fsdp_units(model.module)
            fabric.save(path, {"model": model, "optimizer": optimizer})
    out["losses"] = mean_over_ranks(losses)
    return out


def lightning_default_mesh() -> dict:
    """What worked silently wrong: Lightning's ModelParallelStrategy() defaults give a
    data-parallel mesh of size 1 on one node; annot.auto_wrap must refuse it."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    seen = {}

    def parallelize(module, mesh):
        seen["dp"] = mesh["data_parallel"].size()
        try:
            annot.auto_wrap(module, "fsdp2", mesh=mesh["data_parallel"])
        except ValueError as err:
            seen["error"] = str(err)
        return module

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(),
                      strategy=ModelParallelStrategy(parallelize))
    fabric.launch()
    fabric.setup_module(make_model())
    return seen


def run(*names: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp)  # one folder for every rank (rank 0's)
        scenarios = {
            "trainer-fsdp2": lambda: trainer_fsdp2(tmp[0]),
            "trainer-meta-init": trainer_meta_init,
            "fabric-fsdp2": lambda: fabric_fsdp2(tmp[0]),
            "lightning-default-mesh": lightning_default_mesh,
        }
        out = {name: scenarios[name]() for name in names}
        dist.barrier()  # no rank leaves (and rank 0 deletes the folder) while one still reads
        return out


if __name__ == "__main__":
    worker_main(run)
