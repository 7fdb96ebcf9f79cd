"""What each block of a model can do with its activations, and what each choice costs.

The choices (`CHOICES`), per block (a Plan unit run whole in forward):

- ``none``: autograd keeps what the block saves for backward.
- ``selective``: torch's selective checkpoint with ``"save_matmuls"``
  (`annot.runtime.selective_checkpoint`): the block's input and its matmul and
  attention outputs are kept, the rest is recomputed in backward.
- ``checkpoint``: full checkpoint: only the block's input is kept; backward runs its
  forward again.
- ``checkpoint_offload``: full checkpoint whose kept input waits on the host.
- ``offload``: activation offload (`annot.runtime.activation_offload`): everything the
  block saves waits on the host and comes back for its backward.

**Memory.** One forward under ``FakeTensorMode`` (`profile_blocks`) gives, per block,
the bytes it saves (``keep``), its input's bytes (``input``) and its matmul outputs'
(``matmuls``); what a choice holds on the device from the block's forward to its
backward is `held`. While backward runs block ``i`` (blocks run backward last to
first), blocks before it still hold what their choices keep, and block ``i`` holds its
whole interior again (kept, recomputed or brought back) plus backward's transients; the
planner reads those from the traced step (`annot.memory.budget`), so the peak is checked
at every block of backward, not only at the end of forward.

**Time.** Recomputation is priced from the traced FLOPs at the device's sustained
throughput, plus the element-wise work read and written at its memory bandwidth (the
part of a block that is not matmuls runs at memory speed, not at FLOP speed). A transfer
to or from the host is priced against the window it can overlap: the copy to the host
against the block's own forward, the copy back against the backward of the block after
it (twice the forward's FLOPs); only what does not fit the window adds to the step.
`DEVICES` holds the figures per device kind; every one can be overridden.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from annot.huggingface.model import cache_off_in_training
from annot.memory.activations import InputsFn, _traceable, fake_copy
from annot.memory.counting import FlopCount, storage_key
from annot.memory.inputs import step_inputs
from annot.memory.strategies import MemoryInputError
from annot.runtime.selective_checkpoint import matmul_ops

__all__ = ["CHOICES", "DEVICES", "BlockProfile", "Device", "choice_seconds", "held", "profile_blocks"]

CHOICES: tuple[str, ...] = ("none", "selective", "checkpoint", "checkpoint_offload", "offload")
#: Choices that copy to the host: only where the device is not the host's memory.
OFFLOAD_CHOICES = frozenset({"checkpoint_offload", "offload"})
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Device:
    """A device kind's figures for the cost model: sustained dense TFLOP/s (about half
    the bf16 datasheet peak, as `annot.memory.communication.TFLOPS` for the A100), memory
    bandwidth (GB/s, datasheet), and the host link each direction (GB/s achieved: about
    80% of the PCIe x16 datasheet figure; 0: no offload, the device is host memory)."""

    name: str
    tflops: float
    hbm_bw: float
    host_bw: float
    #: A float8 matmul's speed over a bf16 one (dense datasheet peaks); 1: no float8 matmul.
    float8_speedup: float = 1.0


#: H100 SXM: 989 bf16 TFLOP/s dense, 1979 float8, 3.35 TB/s HBM3, PCIe 5.0 x16 (64 GB/s);
#: H200: the H100's compute, 4.8 TB/s HBM3e, PCIe 5.0; A100 SXM 80GB: 312 TFLOP/s (no
#: float8 matmul), 2.04 TB/s, PCIe 4.0 x16 (32 GB/s) (NVIDIA datasheets). ``cpu``: a CPU
#: run (no offload choice).
DEVICES: dict[str, Device] = {
    "H100": Device("H100", tflops=450.0, hbm_bw=3350.0, host_bw=50.0, float8_speedup=2.0),
    "H200": Device("H200", tflops=450.0, hbm_bw=4800.0, host_bw=50.0, float8_speedup=2.0),
    "A100": Device("A100", tflops=150.0, hbm_bw=2039.0, host_bw=25.0),
    "cpu": Device("cpu", tflops=0.5, hbm_bw=50.0, host_bw=0.0),
}


def device(name: str, *, tflops: float | None = None, hbm_bw: float | None = None,
           host_bw: float | None = None) -> Device:
    """The `DEVICES` entry ``name`` (case-insensitive) with any figure overridden."""
    found = {k.lower(): v for k, v in DEVICES.items()}.get(name.lower())
    if found is None:
        raise MemoryInputError(f"unknown device {name!r}; choose from {', '.join(DEVICES)} "
                               "(or override tflops=, hbm_bw=, host_bw=)")
    out = Device(found.name, tflops=found.tflops if tflops is None else tflops,
                 hbm_bw=found.hbm_bw if hbm_bw is None else hbm_bw,
                 host_bw=found.host_bw if host_bw is None else host_bw, float8_speedup=found.float8_speedup)
    for name_, value in (("tflops", out.tflops), ("hbm_bw", out.hbm_bw)):
        if not value > 0:
            raise MemoryInputError(f"{name_} must be positive, got {value}")
    if out.host_bw < 0:
        raise MemoryInputError(f"host_bw must be positive (0: no offload), got {out.host_bw}")
    return out


@dataclasses.dataclass(frozen=True)
class BlockProfile:
    """One block's forward, traced: bytes it saves for backward (``keep``, parameters
    excluded), its input's bytes (``input``), the bytes of its matmul and attention
    outputs (``matmuls``, what ``selective`` keeps), its forward FLOPs (``flops``) and
    those of its matmuls (``matmul_flops``), and the bytes its other operations write
    (``pointwise``: what recomputing them reads and writes at memory speed)."""

    path: str
    keep: int
    input: int
    matmuls: int
    flops: int
    matmul_flops: int
    pointwise: int


def held(block: BlockProfile, choice: str) -> int:
    """Device bytes ``choice`` keeps for ``block`` from its forward to its backward."""
    # Selective keeps every matmul output (torch's contexts cache them all, needed by
    # backward or not) and the checkpoint's input.
    return {"none": block.keep, "selective": block.input + block.matmuls,
            "checkpoint": block.input, "checkpoint_offload": 0, "offload": 0}[choice]


def choice_seconds(block: BlockProfile, choice: str, dev: Device) -> float:
    """Seconds ``choice`` adds to the step for ``block`` on ``dev`` (module docstring)."""
    flops_per_s, hbm = dev.tflops * 1e12, dev.hbm_bw * GB
    recompute = {
        "none": 0.0, "offload": 0.0,
        # The element-wise part again, read and written at memory speed.
        "selective": (block.flops - block.matmul_flops) / flops_per_s + 2 * block.pointwise / hbm,
    }.get(choice, block.flops / flops_per_s + 2 * block.pointwise / hbm)
    moved = {"checkpoint_offload": block.input, "offload": block.keep}.get(choice, 0)
    if not moved:
        return recompute
    if dev.host_bw <= 0:
        return float("inf")  # no host link: the choice is not available
    transfer = moved / (dev.host_bw * GB)
    forward = block.flops / flops_per_s
    # To the host behind the block's forward, back behind the next block's backward.
    return recompute + max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward)


class _Recorder(TorchDispatchMode):
    """Per block: FLOPs, matmul FLOPs, matmul output storages and other operations'
    output bytes, of what runs while the block is active (``active`` names it)."""

    def __init__(self, flops: FlopCount) -> None:
        super().__init__()
        self.active: list[str] = []
        self.flops = flops
        self.totals: dict[str, dict[str, Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        block = self.totals.setdefault(self.active[-1], {"flops": 0, "matmul_flops": 0,
                                                         "matmul_keys": {}, "pointwise": 0})
        count = self.flops.registry.get(func._overloadpacket)
        flops = int(count(*args, **kwargs, out_val=out)) if count is not None else 0
        block["flops"] += flops
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._overloadpacket in matmul_ops():
            block["matmul_flops"] += flops
            for t in outputs:
                block["matmul_keys"][storage_key(t)] = t.untyped_storage().nbytes()
                # Held until the profile ends: a storage freed within the block could
                # be reused at the same address by a later matmul output and counted
                # once for two (the whole model's profile and a cut one's differed so).
                block.setdefault("alive", []).append(t.untyped_storage())
        else:
            block["pointwise"] += sum(t.numel() * t.element_size() for t in outputs)
        return out


def profile_blocks(model: nn.Module, paths: list[str], *, batch: int, seq: int,
                   dtype: torch.dtype | None = None, autocast: torch.dtype | None = None,
                   inputs: InputsFn | None = None) -> tuple[list[BlockProfile], int]:
    """`BlockProfile` of each module at ``paths`` (forward order is theirs), from one
    training-mode forward and loss of ``model`` under ``FakeTensorMode`` (nothing is
    allocated; ``model`` is not modified), and the bytes saved outside every block."""
    copy, fake_mode = fake_copy(model, dtype)
    params = {storage_key(p) for p in copy.parameters()}
    recorder = _Recorder(FlopCount())
    saved: dict[int, tuple[int, str]] = {}  # storage -> (bytes, first saver; "" outside)
    block_inputs: dict[str, dict[int, int]] = {p: {} for p in paths}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in params and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), recorder.active[-1] if recorder.active else "")
        return t

    def enter(path: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            recorder.active.append(path)
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor) and storage_key(value) not in params:
                    block_inputs[path][storage_key(value)] = value.untyped_storage().nbytes()
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        recorder.active.pop()

    handles = []
    for path in paths:
        handles.append(copy.get_submodule(path).register_forward_pre_hook(enter(path), with_kwargs=True))
        handles.append(copy.get_submodule(path).register_forward_hook(leave))
    copy.train()
    try:
        with fake_mode, recorder, _traceable(), cache_off_in_training(copy), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            args, kwargs, loss_of = step_inputs(inputs, copy, batch, seq)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss_of(copy(*args, **kwargs))
    finally:
        for handle in handles:
            handle.remove()
    profiles = []
    for path in paths:
        totals = recorder.totals.get(path, {"flops": 0, "matmul_flops": 0, "matmul_keys": {}, "pointwise": 0})
        keep = sum(size for size, who in saved.values() if who == path)
        profiles.append(BlockProfile(
            path=path, keep=keep, input=sum(block_inputs[path].values()),
            matmuls=sum(totals["matmul_keys"].values()), flops=totals["flops"],
            matmul_flops=totals["matmul_flops"], pointwise=totals["pointwise"]))
    outside = sum(size for size, who in saved.values() if who == "")
    return profiles, outside
