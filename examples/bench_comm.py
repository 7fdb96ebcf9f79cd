"""Collective bytes per rank of one training step at world size 64, simulated, against the
planner's prediction (`annot.memory.communication`).

    python examples/bench_comm.py              # 4 layers of Llama-2-7B's shape (the test's)
    python examples/bench_comm.py --layers 32  # the whole 7B (about 2 minutes here)

One process plays rank 0 of 64 (8 nodes x 8 GPUs): torch's fake process group (every
collective returns at once, moving nothing) and ``FakeTensorMode`` (shapes only, no
memory). The model is transformers' ``LlamaForCausalLM`` at Llama-2-7B's shape (hidden
4096, 32 heads, intermediate 11008, vocabulary 32000), with fewer decoder layers unless
asked: every layer sends the same, so a step's bytes are the root's plus one layer's
times the layer count. Three layouts, bf16 compute and fp32 gradient reduction
(``MixedPrecisionPolicy`` as annot's ``mixed_precision="bf16"``):

- FSDP2 over all 64 ranks (annot's FSDP2 step, the Plan's units: the decoder layers);
- HSDP: the same over an 8 x 8 ``("replicate", "shard")`` mesh;
- TP 8 x FSDP2 8: torch's ``parallelize_module`` on each layer over the ``"tp"`` dimension
  (q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``), then annot's FSDP2 step
  over ``"shard"``.

A ``TorchDispatchMode`` sees every collective of one forward and backward: the op, its
group (read back from the process group) and the size of the whole tensor (all-gather
output, reduce-scatter input, all-reduce tensor). Bytes each rank sends follow from the
ring algorithm's counts (`annot.memory.communication.ring_bytes`), on both sides.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

WORLD, GPUS_PER_NODE = 64, 8
LLAMA_7B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=32000)
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
           "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
           "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
LAYOUTS = ("fsdp2", "hsdp", "tp-fsdp2")
BATCH, SEQ = 2, 128


class CollectiveBytes(TorchDispatchMode):
    """Per (op, group size, stride between group members): the whole tensors' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[tuple[str, int, int], int] = defaultdict(int)

    def _add(self, op: str, nbytes: int, group: Any) -> None:
        import torch.distributed as dist

        if isinstance(group, str):
            pg = dist.distributed_c10d._resolve_process_group(group)
        else:
            pg = dist.ProcessGroup.unbox(group) if type(group).__name__ == "ScriptObject" else group
        ranks = dist.get_process_group_ranks(pg)
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
        self.sizes[(op, len(ranks), stride)] += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        if func.namespace == "c10d":
            if name == "_allgather_base_":
                self._add("all-gather", nbytes(args[0]), args[2])
            elif name == "_reduce_scatter_base_":
                self._add("reduce-scatter", nbytes(args[1]), args[2])
            elif name == "allreduce_":
                self._add("all-reduce", sum(nbytes(t) for t in args[0]), args[1])
            elif name not in ("barrier", "broadcast_"):
                raise NotImplementedError(f"collective {func} is not counted")
        elif func.namespace == "_c10d_functional":
            if name == "all_reduce":
                self._add("all-reduce", nbytes(args[0]), args[2])
            elif name == "all_gather_into_tensor":
                self._add("all-gather", nbytes(args[0]) * args[1], args[2])
            elif name == "reduce_scatter_tensor":
                self._add("reduce-scatter", nbytes(args[0]), args[3])
            elif name != "wait_tensor":
                raise NotImplementedError(f"collective {func} is not counted")
        return func(*args, **kwargs)


def _layout(name: str) -> Any:
    from annot.memory.communication import Layout

    if name == "fsdp2":
        return Layout(shard=WORLD)
    if name == "hsdp":
        return Layout(replicate=WORLD // GPUS_PER_NODE, shard=GPUS_PER_NODE)
    return Layout(shard=WORLD // GPUS_PER_NODE, tp=GPUS_PER_NODE)


def _dim(layout: Any, ranks: int, stride: int) -> str:
    for dim in ("tp", "shard", "replicate"):
        if layout.group(dim) == (ranks, stride if ranks > 1 else layout.group(dim)[1]):
            return dim
    raise AssertionError(f"a group of {ranks} ranks {stride} apart is no dimension of {layout}")


def _config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **LLAMA_7B)


def simulate(layout_name: str, layers: int) -> dict[tuple[str, str], int]:
    """(op, layout dimension) -> whole-tensor bytes of rank 0's collectives in one
    forward and backward, simulated at world size 64."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaForCausalLM

    import annot
    from annot.engines.fsdp2 import apply_fsdp2

    layout = _layout(layout_name)
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        fake = FakeTensorMode()
        with fake:
            model = LlamaForCausalLM(_config(layers))
        plan = annot.plan(model)
        # Meshes and sharding outside the fake mode (a mesh computes its ranks with real
        # tensors); the parameters are fake, so sharding them allocates nothing.
        if layout_name == "tp-fsdp2":
            mesh = init_device_mesh("cpu", (layout.shard, layout.tp), mesh_dim_names=("shard", "tp"))
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            for layer in model.model.layers:
                parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
            shard_mesh = mesh["shard"]
        elif layout_name == "hsdp":
            shard_mesh = init_device_mesh("cpu", (layout.replicate, layout.shard),
                                          mesh_dim_names=("replicate", "shard"))
        else:
            shard_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
        apply_fsdp2(model, plan, offload=False, mixed_precision=torch.bfloat16,
                    reshard_after_forward=True, mesh=shard_mesh, device=torch.device("cpu"))
        counter = CollectiveBytes()
        with fake:
            ids = torch.randint(0, LLAMA_7B["vocab_size"], (BATCH, SEQ))
            with counter:
                model(input_ids=ids, labels=ids).loss.backward()
    finally:
        dist.destroy_process_group()
    found: dict[tuple[str, str], int] = defaultdict(int)
    for (op, ranks, stride), size in counter.sizes.items():
        found[(op, _dim(layout, ranks, stride))] += size
    return dict(found)


def predict(layout_name: str, layers: int) -> dict[tuple[str, str], int]:
    """The planner's (op, layout dimension) -> whole-tensor bytes for the same step."""
    from transformers import LlamaForCausalLM

    import annot
    from annot.memory.communication import Dtypes, param_records, step_collectives, tp_styles

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers))
    plan = annot.plan(model)
    layout = _layout(layout_name)
    tp = None
    if layout.tp > 1:
        styles = tp_styles(model, {f"model.layers.*.{k}": v for k, v in TP_PLAN.items()})
        tp = (model, styles, BATCH * SEQ, set())
    collectives = step_collectives("fsdp2", stage=3, records=param_records(model, plan), layout=layout,
                                   dtypes=Dtypes(gather=2, reduce=4, activation=2), tp=tp)
    found: dict[tuple[str, str], int] = defaultdict(int)
    for c in collectives:
        found[(c.op, c.dim)] += c.size
    return dict(found)


def compare(layout_name: str, layers: int) -> list[tuple[str, str, float, float]]:
    """(op, dimension, simulated bytes each rank sends, predicted) per collective kind."""
    from annot.memory.communication import ring_bytes

    layout = _layout(layout_name)
    counted, predicted = simulate(layout_name, layers), predict(layout_name, layers)
    rows = []
    for op, dim in sorted(set(counted) | set(predicted)):
        ranks = layout.group(dim)[0]
        rows.append((op, dim, ring_bytes(op, counted.get((op, dim), 0), ranks),
                     ring_bytes(op, predicted.get((op, dim), 0), ranks)))
    return rows


def main() -> None:
    layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 4
    print(f"Llama-2-7B shape, {layers} layers, batch {BATCH} x seq {SEQ}, world {WORLD} "
          f"({WORLD // GPUS_PER_NODE} nodes x {GPUS_PER_NODE}); bytes each rank sends in one step")
    print("| layout | collective | group | simulated (MiB) | planner (MiB) | error |")
    print("|---|---|---|---:|---:|---:|")
    for name in LAYOUTS:
        for op, dim, counted, predicted in compare(name, layers):
            error = predicted / counted - 1 if counted else float("inf")
            print(f"| {name} | {op} | {dim} | {counted / 2**20:.1f} | {predicted / 2**20:.1f} "
                  f"| {error:+.2%} |")


if __name__ == "__main__":
    main()
