"""Run under torchrun (4 ranks) by test_hsdp.py: HSDP-style layouts of the tiny Llama.

    python -m torch.distributed.run --nproc_per_node 4 hsdp_worker.py OUT DIR SCENARIO [...]

DIR holds ``base`` (the eager Llama, ``save_pretrained``); the worker writes beside it.
For ``fsdp2`` and ``fsdp1`` (2 replicas x 2 shards, `annot.ParallelDims(replicate=2)`):

- ``train``: ``auto_wrap`` the eager Llama, train `STEPS` steps on this rank's rows,
  recording the global loss and every full gradient per step; `annot.save_state` after
  `SAVE_AFTER` steps, `annot.save` at the end; the engine's layout (placements, groups);
- ``resume``: a fresh wrap, `annot.load_state` of that state, the remaining steps;
- ``reload``: `annot.from_pretrained` of the saved weights into the same layout;
- ``pretrained``: `annot.from_pretrained` of ``base`` (meta init + each rank reading its
  shard); ``meta``: the Llama built under `annot.meta_init`, wrapped, materialized.

``zero3-hpz``: ZeRO-3 with ``hpz_partition_size=2`` trained from ``from_pretrained(base)``
(meta init, partitions filled after DeepSpeed cut its secondary copies from undefined
values: docs/design.md, pitfall 27).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import annot
from tests.distributed import worker_main
from tests.engines.hsdp_cases import (
    ENGINES,
    SAVE_AFTER,
    batches,
    llama,
    make_optimizer,
    rank_rows,
)

DIMS = annot.ParallelDims(replicate=2)
_FSDP1_LEVEL = "_fsdp_wrapped_module."


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def _gathered(trainer: annot.Trainable, grads: bool) -> dict[str, torch.Tensor | None]:
    """Every parameter (or its gradient), whole, by bare name (collective)."""
    if trainer.engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.module, with_grads=grads):
            return {n.replace(_FSDP1_LEVEL, ""): _full(p.grad if grads else p)
                    for n, p in trainer.module.named_parameters()}
    if trainer.engine == "deepspeed":
        import deepspeed
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, param in trainer.model.named_parameters():
            if grads:
                out[name] = _full(safe_get_full_grad(param))
            else:
                with deepspeed.zero.GatheredParameters([param]):
                    out[name] = _full(param)
        return out
    return {n: _full(p.grad if grads else p) for n, p in trainer.model.named_parameters()}


def _step(trainer: annot.Trainable, batch: dict[str, torch.Tensor], facts: dict) -> tuple[float, dict]:
    """One training step on this rank's rows: the global loss and the full gradients."""
    loss = trainer(**rank_rows(batch, dist.get_rank())).loss
    trainer.backward(loss)
    grads = _gathered(trainer, grads=True)
    if trainer.engine == "deepspeed" and "secondary_group" not in facts:
        # hpZ at work: after forward, each parameter keeps a secondary partition over
        # its group of 2 ranks (DeepSpeed drops them at every step and cuts them anew).
        sizes = {getattr(p, "ds_secondary_tensor_group_size", None) for p in trainer.model.parameters()
                 if getattr(p, "ds_secondary_tensor", None) is not None}
        facts["secondary_group"] = sorted(sizes)
    trainer.step()
    trainer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size(), grads


def _layout(trainer: annot.Trainable) -> dict:
    """Where the engine put the parameters, read from its own state."""
    if trainer.engine == "fsdp2":
        weight = trainer.model.model.layers[0].self_attn.q_proj.weight
        return {"placements": [str(p) for p in weight.placements],
                "mesh": tuple(weight.device_mesh.mesh.shape),
                "names": weight.device_mesh.mesh_dim_names}
    if trainer.engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = FullyShardedDataParallel.fsdp_modules(trainer.module)
        return {"strategies": sorted({u.sharding_strategy.name for u in units}),
                "shard_group": trainer.module.process_group.size(),
                "replicate_group": trainer.module._inter_node_pg.size()}
    return {}


def _wrap(scenario: str, model: nn.Module, **extra) -> annot.Trainable:
    engine, options = ENGINES[scenario]
    mesh = {} if engine == "deepspeed" else {"mesh": DIMS}
    return annot.auto_wrap(model, engine, optimizer=make_optimizer, checkpoint=False,
                           **mesh, **options, **extra)


def _pretrained(scenario: str, directory: Path) -> annot.Trainable:
    engine, options = ENGINES[scenario]
    mesh = {} if engine == "deepspeed" else {"mesh": DIMS}
    return annot.from_pretrained(str(directory), engine, optimizer=make_optimizer, checkpoint=False,
                                 **mesh, **options).train()


def _train(trainer: annot.Trainable, steps: list, facts: dict,
           state: Path | None = None) -> tuple[list[float], list[dict]]:
    losses, grads = [], []
    for i, batch in steps:
        loss, grad = _step(trainer, batch, facts)
        losses.append(loss)
        grads.append(grad)
        if state is not None and i + 1 == SAVE_AFTER:
            annot.save_state(state, trainer, step=i + 1)
    return losses, grads


def torch_engine(scenario: str, root: Path) -> dict:
    facts: dict = {}
    all_steps = list(enumerate(batches()))
    state, saved = root / f"{scenario}-state", root / f"{scenario}-saved"

    trainer = _wrap(scenario, llama())
    facts["layout"] = _layout(trainer)
    losses, grads = _train(trainer, all_steps, facts, state)
    trained = _gathered(trainer, grads=False)
    annot.save(trainer, saved)

    resumed = _wrap(scenario, llama())
    annot.load_state(state, resumed)
    resumed_losses, _ = _train(resumed, all_steps[SAVE_AFTER:], facts)
    reloaded = _pretrained(scenario, saved)
    pretrained = _pretrained(scenario, root / "base")
    with annot.meta_init():
        meta = llama()
    meta_trainer = _wrap(scenario, meta)
    return {"losses": losses, "grads": grads, "trained": trained, "layout": facts["layout"],
            "resumed_losses": resumed_losses, "resumed": _gathered(resumed, grads=False),
            "reloaded": _gathered(reloaded, grads=False),
            "pretrained": _gathered(pretrained, grads=False),
            "pretrained_layout": _layout(pretrained),
            "meta": _gathered(meta_trainer, grads=False)}


def zero3_hpz(scenario: str, root: Path) -> dict:
    """From ``from_pretrained`` (meta init, then each rank's partitions read from the
    files): the path where DeepSpeed cut its hpZ secondary copies before values came."""
    facts: dict = {}
    losses, grads = _train(_pretrained(scenario, root / "base"), list(enumerate(batches())), facts)
    return {"losses": losses, "grads": grads, "secondary_group": facts["secondary_group"]}


def run(directory: str, *scenarios: str) -> dict:
    root = Path(directory)
    out = {}
    for scenario in scenarios:
        run_one = zero3_hpz if ENGINES[scenario][0] == "deepspeed" else torch_engine
        out[scenario] = run_one(scenario, root)
    return out


if __name__ == "__main__":
    worker_main(run)
