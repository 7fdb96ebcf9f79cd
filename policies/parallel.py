"""`ParallelDims`: how many ranks each parallel dimension spans, as sizes.

A layout over ``world`` ranks is four sizes whose product is the world: ``replicate``
(data-parallel replicas, outermost, e.g. across nodes: HSDP), ``shard`` (ranks one
replica's parameters are sharded over), ``cp`` (context parallel: ranks that split one
batch's sequences; parameters are sharded over ``shard x cp``) and ``tp`` (tensor
parallel, innermost: consecutive ranks), the order torchtitan uses ([dp_replicate,
dp_shard, cp, tp]). The
names are also the dimension names of the device mesh the engines build from it
(`annot.engines.mesh`). ``ep`` (expert parallelism: each MoE layer's experts split over
``ep`` ranks, tokens sent to their experts' ranks) spans no ranks of its own: it splits
the ranks of the data-parallel dimensions (torchtitan borrows it from dp_shard the same
way), so it takes no part in the product; it must divide ``replicate x shard`` (FSDP2,
which splits experts, asks that it divide ``shard``: each replica splits them alike).
Pure data: no torch, so the Plan can carry it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["DIM_NAMES", "ParallelDims"]

#: The mesh dimension names, outermost first.
DIM_NAMES = ("replicate", "shard", "cp", "tp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the parallel dimensions; ``-1`` (at most one) means "the rest of the
    world". ``ParallelDims(replicate=2)`` on 16 ranks is HSDP: 2 replicas, each sharded
    over 8 ranks. ``replicate=1, shard=-1, cp=1, tp=1`` (the defaults) is plain sharding.
    ``ParallelDims(cp=2)`` on 8 ranks splits each batch's sequences over pairs of ranks
    (4 data-parallel groups) and shards parameters over all 8 (``shard x cp``).

    `resolve` checks the sizes against a world and fills in ``-1``: sizes whose product
    is not the world, or a ``-1`` left with one rank (the layout asked for is not there),
    are `ValueError`s that say which sizes fit.
    """

    replicate: int = 1
    shard: int = -1
    cp: int = 1
    tp: int = 1
    #: Expert parallelism (see the module docstring): FSDP2's, on transformers MoE
    #: models (`annot.engines.fsdp2_experts`); the other engines refuse it
    #: (`annot.engines.mesh.refuse_expert_parallel`).
    ep: int = 1

    def __post_init__(self) -> None:
        for name, size in {**self.sizes, "ep": self.ep}.items():
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"ParallelDims({name}={size!r}): a size is a positive int, "
                                 "or -1 for the rest of the world")
        if self.ep == -1:
            raise ValueError("ParallelDims(ep=-1): ep takes no rest of the world (it splits the "
                             "data-parallel ranks); give the number of ranks the experts span")
        rest = [name for name, size in self.sizes.items() if size == -1]
        if len(rest) > 1:
            raise ValueError(f"ParallelDims: {' and '.join(rest)} are both -1; at most one "
                             "dimension takes the rest of the world, give the others as sizes")

    @property
    def sizes(self) -> dict[str, int]:
        """``{name: size}``, outermost first (``-1`` as given)."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def resolved(self) -> bool:
        """Whether every size is known (no ``-1``)."""
        return -1 not in self.sizes.values()

    def resolve(self, world: int) -> ParallelDims:
        """These dims on ``world`` ranks, ``-1`` filled in; a `ValueError` naming the fix
        when they do not fit."""
        known = math.prod(s for s in self.sizes.values() if s != -1)
        rest = next((name for name, size in self.sizes.items() if size == -1), None)
        if rest is None:
            if known != world:
                raise ValueError(
                    f"{self} spans {known} ranks, but the world has {world}: give sizes "
                    f"whose product is {world}, or shard=-1 for the rest")
            self._check_ep()
            return self
        if world % known:
            raise ValueError(
                f"{self} on {world} ranks: {world} is not a multiple of {known} (the product "
                f"of the other sizes), so {rest}=-1 has no size: choose sizes that divide {world}")
        # shard=1 beside cp > 1 still shards: parameters are sharded over shard x cp.
        if world // known == 1 and world > 1 and not (rest == "shard" and self.cp > 1):
            raise ValueError(
                f"{self} on {world} ranks leaves {rest}=1: the other sizes already take every "
                f"rank, so nothing is {_VERB[rest]}. Give a smaller "
                f"{' or '.join(n for n, s in self.sizes.items() if s > 1)}, or set {rest}=1 "
                "if that is what you mean")
        resolved = dataclasses.replace(self, **{rest: world // known})
        resolved._check_ep()
        return resolved

    def _check_ep(self) -> None:
        data = self.replicate * self.shard
        if data % self.ep:
            raise ValueError(f"{self}: ep={self.ep} must divide the data-parallel ranks "
                             f"(replicate x shard = {data}): experts are split among them")

    @property
    def world(self) -> int | None:
        """The number of ranks these dims span (``None`` while a size is ``-1``)."""
        return math.prod(self.sizes.values()) if self.resolved else None

    def describe(self) -> str:
        """``"replicate 2 x shard 4 x tp 1 (8 ranks)"``, for tables and messages (``cp``
        only when it is not 1)."""
        dims = " x ".join(f"{n} {'rest' if s == -1 else s}" for n, s in self.sizes.items()
                          if n != "cp" or s != 1)
        experts = f", experts over ep {self.ep}" if self.ep != 1 else ""
        return dims + (f" ({self.world} ranks)" if self.world is not None else "") + experts

    def meaning(self) -> str:
        """What the layout does, in words (``"HSDP: 2 replicas, each sharded over 4 ranks"``)."""
        sizes = self.sizes
        shard = ("the rest of the ranks" if sizes["shard"] == -1
                 else f"{sizes['shard']} rank{'s' if sizes['shard'] != 1 else ''}")
        if sizes["replicate"] != 1:
            data = (f"HSDP: {'some' if sizes['replicate'] == -1 else sizes['replicate']} replicas, "
                    f"each sharded over {shard}")
        else:
            data = f"sharded over {shard}"
        if sizes["cp"] != 1:
            data += (f", sequences split over {'the rest' if sizes['cp'] == -1 else sizes['cp']}"
                     " (context parallel; parameters sharded over shard x cp)")
        if sizes["tp"] != 1:
            data += f", tensor parallel over {'the rest' if sizes['tp'] == -1 else sizes['tp']}"
        if self.ep != 1:
            # Said where the layout is shown (annot plan --parallel), not only when wrapping.
            data += (f", each MoE layer's experts split over {self.ep} ranks (FSDP2, "
                     "transformers MoE models)")
        return data

    def __str__(self) -> str:
        return "ParallelDims(" + ", ".join(f"{n}={s}" for n, s in self.to_dict().items()) + ")"

    def to_dict(self) -> dict[str, int]:
        """The sizes, ``cp`` and ``ep`` only where they are not 1 (a Plan's JSON without
        context or expert parallelism keeps its shape)."""
        sizes = {n: s for n, s in self.sizes.items() if n != "cp" or s != 1}
        return {**sizes, **({"ep": self.ep} if self.ep != 1 else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelDims:
        unknown = set(data) - {*DIM_NAMES, "ep"}
        if unknown:
            raise ValueError(f"ParallelDims has no dimension {', '.join(sorted(unknown))}; "
                             f"it has {', '.join((*DIM_NAMES, 'ep'))}")
        return cls(**{k: int(v) for k, v in data.items()})

    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        """``"replicate=2,shard=-1"`` (the ``annot plan --parallel`` syntax)."""
        data: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            try:
                data[name.strip()] = int(value) if sep else None
            except ValueError:
                data[name.strip()] = None
            if data[name.strip()] is None:
                raise ValueError(f"--parallel: {item!r} is not NAME=SIZE "
                                 "(e.g. replicate=2,shard=-1)")
        return cls.from_dict(data)


_VERB = {"replicate": "replicated", "shard": "sharded", "cp": "split along the sequence",
         "tp": "split by tensor parallelism"}
