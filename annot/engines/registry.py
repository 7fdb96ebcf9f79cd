"""Engine names, resolved here and nowhere else.

The one generic module that imports an engine's module (`.ci/check_imports.py`
enforces it): everything else asks an `Engine` found here, by name (`get_engine`) or
all of them (`all_engines`), for what it needs (docs/design.md, "Engine contract").
"""

from __future__ import annotations

from typing import Any

from annot.engines.base import Engine

__all__ = ["ENGINES", "all_engines", "get_engine", "resolve_engine"]

# Every engine name a user may write -> the canonical one.
ENGINES: dict[str, str] = {
    "fsdp2": "fsdp2",
    "fully_shard": "fsdp2",
    "ddp": "ddp",
    "fsdp1": "fsdp1",
    "fsdp": "fsdp1",  # torch's FullyShardedDataParallel class, as Lightning names it
    "deepspeed": "deepspeed",
}


def resolve_engine(engine: str) -> str:
    """The canonical engine name for ``engine`` (case-insensitive), or `ValueError`."""
    key = engine.lower().replace("-", "_") if isinstance(engine, str) else engine
    if key not in ENGINES:
        raise ValueError(
            f"unknown engine {engine!r}: choose one of {', '.join(sorted(set(ENGINES.values())))}")
    return ENGINES[key]


def get_engine(engine: str) -> Engine[Any]:
    """A new `Engine` for ``engine``; its module (and so torch.distributed's) is imported
    only now, so ``import annot`` stays light."""
    name = resolve_engine(engine)
    if name == "fsdp2":
        from annot.engines.fsdp2 import FSDP2

        return FSDP2()
    if name == "fsdp1":
        from annot.engines.fsdp1 import FSDP1

        return FSDP1()
    if name == "ddp":
        from annot.engines.ddp import DDP

        return DDP()
    from annot.engines.deepspeed import DeepSpeed

    return DeepSpeed()


def all_engines() -> list[Engine[Any]]:
    """A new `Engine` of every engine, for questions asked of a model whichever engine
    wrapped it (`annot.engines.layout`)."""
    return [get_engine(name) for name in sorted(set(ENGINES.values()))]
