"""Run by torchrun (2 ranks, gloo): train float8 and compiled models through `annot.auto_wrap`.

``speed_worker.py OUT train SCENARIO ...``: each SCENARIO is ``MODEL:RECIPE:ENGINE:CHECKPOINT[:BACKEND]``
(``RECIPE`` ``none`` for no float8; ``ENGINE`` ``fsdp2``, ``fsdp2ag`` (float8 all-gather),
``ddp`` or ``fsdp1``; ``CHECKPOINT`` ``ckpt`` or ``plain``; ``BACKEND`` a compile backend). Rank 0
saves, per scenario, every rank's losses, the weights after the steps (whole) and the
compiled blocks' statuses and graph breaks.

``speed_worker.py OUT resume DIR FROM TO``: a run configured ``FROM`` (a scenario, as above)
trains 3 steps and saves its state to DIR; a model configured ``TO`` loads it. Rank 0 saves
the saver's weights and optimizer state at the save (whole, in memory), the loader's
after the load, and the loader's next loss on each rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import annot
from annot.compiled_blocks import compile_report
from tests.distributed import worker_main
from tests.speed.cases import STEPS, batch, loss_of, make_model, optimizer, policy

RESUME_AT = 3


def wrap(scenario: str) -> annot.Trainable:
    name, recipe, engine, checkpoint, *backend = scenario.split(":")
    model = make_model(name)
    stage = {"zero2": {"stage": 2}, "zero3": {"stage": 3}}.get(engine)
    return annot.auto_wrap(
        model, "deepspeed" if stage else "fsdp2" if engine.startswith("fsdp2") else engine, policy(name),
        **(stage or {}), checkpoint=checkpoint == "ckpt", optimizer=optimizer,
        float8=recipe if recipe != "none" else None,
        float8_all_gather=True if engine == "fsdp2ag" else (False if engine == "fsdp2" and recipe != "none"
                                                            else None),
        compile=backend[0] if backend else None)


def whole(tensor: Any) -> torch.Tensor:
    """A state tensor whole, as a plain tensor (float8 all-gather's weights are a subclass)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if type(tensor) is not torch.Tensor and isinstance(tensor, torch.Tensor) and hasattr(tensor, "_tensor"):
        tensor = tensor._tensor
    return tensor.detach().clone()


def weights(trainable: annot.Trainable) -> dict[str, torch.Tensor]:
    """Every weight whole, by its bare name (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if trainable.engine == "deepspeed":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trainable.model.parameters())):
            return {n: whole(p) for n, p in trainable.model.named_parameters()}
    state = get_model_state_dict(trainable.module, options=StateDictOptions(full_state_dict=True))
    return {n: whole(t) for n, t in state.items()}


def train(scenario: str, steps: int = STEPS) -> dict[str, Any]:
    rank = dist.get_rank()
    trainable = wrap(scenario)
    losses = []
    for step in range(steps):
        loss = loss_of(scenario.split(":")[0], trainable, batch(step, rank))
        trainable.backward(loss)
        trainable.step()
        trainable.zero_grad()
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, loss.item())
        losses.append(gathered)
    report = compile_report(trainable.model)
    return {"losses": losses, "weights": weights(trainable),
            "compiled": [(c.path, c.status, c.graph_breaks, c.reason) for c in report]}


def optimizer_state(trainable: annot.Trainable) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(trainable.model, trainable.optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    return {f"{name}.{key}": whole(value) for name, entry in state["state"].items()
            for key, value in entry.items()}


def resume(directory: str, saver: str, loader: str) -> dict[str, Any]:
    rank = dist.get_rank()
    first = wrap(saver)
    for step in range(RESUME_AT):
        loss = loss_of(saver.split(":")[0], first, batch(step, rank))
        first.backward(loss)
        first.step()
        first.zero_grad()
    annot.save_state(directory, first, step=RESUME_AT)
    saved = {"weights": weights(first), "optimizer": optimizer_state(first)}
    second = wrap(loader)
    annot.load_state(directory, second)
    loaded = {"weights": weights(second), "optimizer": optimizer_state(second)}
    loss = loss_of(loader.split(":")[0], second, batch(RESUME_AT, rank))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, loss.item())
    return {"saved": saved, "loaded": loaded, "next_losses": gathered}


def run(kind: str, *args: str) -> dict[str, Any]:
    if kind == "train":
        return {scenario: train(scenario) for scenario in args}
    if kind == "resume":
        return resume(*args)
    raise ValueError(kind)


if __name__ == "__main__":
    worker_main(run)
