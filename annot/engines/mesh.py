"""Device meshes for the engines: built from `ParallelDims`, read by dimension name.

The one convention (shared with tensor parallelism): a mesh's dimensions are named
``"replicate"``, ``"shard"``, ``"cp"`` and ``"tp"``, outermost first. A ``"cp"``
(context parallel) dimension of more than one rank is flattened with ``"shard"`` into
one dimension, ``"shard_cp"``, that parameters are sharded over (torchtitan's
``dp_shard_cp``): the ranks of a cp group hold the same parameters, so they share their
shards as data-parallel ranks do; the sequence split is `annot.runtime.context_parallel`'s. A 1-D mesh is sharded over;
an unnamed 2-D mesh is (replicate, shard) by position, as FSDP1's ``HYBRID_SHARD`` reads
it (torch 2.13's ``fully_shard`` asks for names: FSDP2 refuses it with the fix); a named
mesh is read by its names. Without torch 2.13's new ``dp_mesh_dims`` both torch engines
read a 2-D mesh by position only, whatever its names say, so a mesh named otherwise, or
in another order, is refused here rather than sharded over the wrong ranks
(docs/design.md, pitfall 25).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from annot.engines.checks import require_process_group
from annot.policies.parallel import DIM_NAMES, ParallelDims

__all__ = [
    "SHARD_CP", "MeshLike", "build_mesh", "context_parallel_mesh", "data_parallel_mesh",
    "refuse_context_parallel", "refuse_expert_parallel", "refuse_plan_dims", "requested_dims",
    "resolve_mesh",
    "split_mesh",
]

#: The name of the flattened ``("shard", "cp")`` dimension FSDP2 shards over.
SHARD_CP = "shard_cp"

MeshLike = DeviceMesh | ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh ``(replicate, shard, tp)`` over the world for ``dims``, with ``cp``
    between shard and tp when it is not 1 (resolved against the world first: sizes that
    do not fit are a `ValueError`)."""
    sizes = {n: s for n, s in dims.resolve(dist.get_world_size()).sizes.items()
             if n != "cp" or s != 1}
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def requested_dims(mesh: MeshLike | None, plan_dims: ParallelDims | None) -> ParallelDims | None:
    """The `ParallelDims` asked for: the option's, else the Plan's (``None`` when a
    `DeviceMesh` is given, or nothing). Dims given both ways must agree."""
    if isinstance(mesh, ParallelDims) and plan_dims is not None and mesh != plan_dims:
        raise ValueError(f"mesh={mesh} differs from the Plan's parallel dims {plan_dims}: "
                         "give them in one place")
    if isinstance(mesh, DeviceMesh) and plan_dims is not None and plan_dims.ep != 1:
        # A mesh says nothing of experts: the Plan's ep would be dropped without a word.
        raise ValueError(f"the Plan's parallel dims {plan_dims} ask for expert parallelism "
                         f"(ep={plan_dims.ep}), which a DeviceMesh cannot carry: pass "
                         "mesh=annot.ParallelDims(...) instead of the mesh")
    return mesh if isinstance(mesh, ParallelDims) else plan_dims if mesh is None else None


def resolve_mesh(mesh: MeshLike | None, plan_dims: ParallelDims | None,
                 device_type: str, engine: str, *, expert_parallel: bool = False) -> DeviceMesh | None:
    """The mesh ``engine`` gets: ``mesh`` as given, a mesh built from `ParallelDims` (the
    option's, else the Plan's: `requested_dims`), or ``None`` (the engine's default:
    every rank). Building a mesh needs the process group (annot's error says so before
    torch's would). ``ep`` above 1 is refused unless the engine splits experts
    (``expert_parallel``: FSDP2, whose experts mesh is its own, `annot.engines.fsdp2_experts`)."""
    dims = requested_dims(mesh, plan_dims)
    if not expert_parallel:
        refuse_expert_parallel(dims, engine)
    if dims is not None:
        require_process_group(engine)
        return build_mesh(dims, device_type)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh= takes a DeviceMesh or annot.ParallelDims, not {type(mesh).__name__}")
    return mesh


def refuse_expert_parallel(dims: ParallelDims | None, engine: str) -> None:
    """Expert parallelism (``ParallelDims(ep=N)``, N > 1) is FSDP2's: every other engine
    refuses it before the model changes. Ignoring the ask would train correctly but keep
    every expert's shard on every data-parallel rank, which is not what the user sized
    their run for."""
    if dims is not None and dims.ep != 1:
        raise ValueError(
            f"{dims}: expert parallelism (ep={dims.ep}) is not available on engine {engine!r}: "
            "use engine='fsdp2', or drop ep= (ParallelDims(ep=1)): every engine then shards "
            "each MoE layer's fused expert stacks over the data-parallel ranks like any other "
            "parameter (the Plan's 'moe:' lines list them)")


def refuse_plan_dims(plan_dims: ParallelDims | None, engine: str, instead: str,
                     *, context_parallel: bool = False) -> None:
    """An engine without meshes (DDP, DeepSpeed) cannot honour a Plan whose parallel
    dims ask for replicas or tensor parallelism: refused rather than ignored (expert
    parallelism first, with its own reason: `refuse_expert_parallel`). Context
    parallelism is refused too unless the engine has it (``context_parallel``: DeepSpeed)."""
    refuse_expert_parallel(plan_dims, engine)
    if not context_parallel:
        refuse_context_parallel(plan_dims, engine)
    if plan_dims is not None and (plan_dims.replicate != 1 or plan_dims.tp != 1):
        raise ValueError(f"the Plan's parallel dims {plan_dims} need a device mesh, which engine "
                         f"{engine!r} does not take: {instead}, or plan without parallel=")


def refuse_context_parallel(dims: MeshLike | None, engine: str) -> None:
    """Context parallelism is FSDP2's and DeepSpeed's (their `Trainable` splits the
    sequences): any other engine refuses dims or a mesh with ``cp`` above 1, rather than
    train each rank on a part of the sequence as if it were the whole."""
    cp = 1
    if isinstance(dims, ParallelDims):
        cp = dims.cp
    elif isinstance(dims, DeviceMesh) and (found := context_parallel_mesh(dims)) is not None:
        cp = found.size()
    if cp != 1:
        raise ValueError(f"engine {engine!r} has no context parallelism (cp={cp}): use "
                         "engine='fsdp2' or 'deepspeed', or parallel dims with cp=1")


def context_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh``'s ``"cp"`` dimension, or ``None`` when it has none or one of a single rank."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names and mesh["cp"].size() > 1:
        return mesh["cp"]
    return None


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The part of ``mesh`` that shards parameters: 1-D (shard) or 2-D (replicate,
    shard), in the order ``fully_shard`` and FSDP1 read it. A named mesh's ``tp``
    dimension is left to tensor parallelism, and a ``replicate`` of size 1 is dropped
    (plain sharding). A ``"cp"`` dimension of more than one rank is flattened with
    ``"shard"`` (`SHARD_CP`), which takes shard's place. Refuses names it does not know,
    and dimensions out of order."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim > 2:
            raise ValueError(f"an unnamed {mesh.ndim}-D mesh: name its dimensions "
                             f"{', '.join(map(repr, DIM_NAMES))} (outermost first)")
        return mesh  # 1-D: shard; 2-D: (replicate, shard) by position
    if mesh.ndim == 1:
        return mesh  # one dimension: shard over it, whatever it is called
    known = {**{n: i for i, n in enumerate(DIM_NAMES)}, SHARD_CP: DIM_NAMES.index("shard")}
    unknown = [n for n in names if n not in known]
    if unknown or not {"shard", SHARD_CP} & set(names):
        raise ValueError(
            f"mesh dimensions {names}: annot reads a named mesh by the names "
            f"{', '.join(map(repr, DIM_NAMES))} (torch's fully_shard and FSDP1 would read a "
            "2-D mesh by position, as (replicate, shard), whatever it is called): name them "
            "so, or pass the data-parallel dimension alone (mesh['dp'])")
    order = [known[n] for n in names]
    if order != sorted(order):
        raise ValueError(
            f"mesh dimensions {names} are out of order: replicate must be outermost and tp "
            "innermost (torch's engines read (replicate, shard) by position); build it as "
            f"init_device_mesh(..., mesh_dim_names={tuple(n for n in DIM_NAMES if n in names)})")
    hybrid = "replicate" in names and mesh["replicate"].size() > 1
    shard = SHARD_CP if SHARD_CP in names else "shard"
    if context_parallel_mesh(mesh) is not None:
        flat = mesh["shard", "cp"]._flatten(SHARD_CP)
        if not hybrid:
            return flat  # kept as torch returns it (slicing it back out of the root is deprecated)
        shard = SHARD_CP
    if hybrid:
        return mesh["replicate", shard]
    return mesh[shard]


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the data-parallel part of ``mesh`` (`data_parallel_mesh`), its ``"tp"`` dimension
    or ``None``): ``None`` when the mesh has no ``"tp"`` dimension or one of a single rank,
    so nothing is split. ``"tp"`` alone leaves FSDP nothing to shard over: refused."""
    names = mesh.mesh_dim_names or ()
    if names == ("tp",):
        raise ValueError(
            "mesh dimensions ('tp',): FSDP2 needs a data-parallel dimension besides 'tp'; for "
            "tensor parallelism alone use a ('shard', 'tp') mesh of shape (1, world)")
    data = data_parallel_mesh(mesh)
    if "tp" in names and mesh["tp"].size() > 1:
        return data, mesh["tp"]
    return data, None
