"""What a GPU kind gives a training process and what it takes before the first tensor
(issue #31: the reserve replaces a flat 1 GiB guess, the default GPU is no longer
80 GiB when an H100 has 79.6 GiB).

``memory`` is the total the driver reports (``nvidia-smi``'s "Total", the same as
``torch.cuda.get_device_properties(i).total_memory``), in MiB as NVIDIA's tools print it.
The reserve is what no count of tensors sees but the GPU's memory holds:

- ``context``: the CUDA context of one process (kernels of torch and its libraries
  loaded lazily, ``CUDA_MODULE_LOADING=LAZY``, torch's default since CUDA 11.7). An
  allowance, not a measurement here: no GPU was available where this table was written.
- ``cublas``: the cuBLAS workspace torch sets per handle and stream
  (``CUBLAS_WORKSPACE_CONFIG``'s default in torch's ``CublasHandlePool.cpp``: ``:4096:8``,
  32 MiB, on Hopper; ``:4096:2:16:8``, 8.125 MiB, before it), times two streams (the
  compute stream and one side stream of FSDP2's or DeepSpeed's all-gathers).
- ``nccl``: NCCL's buffers per communicator (``NCCL_BUFFSIZE``, 4 MiB per channel and
  peer and protocol, and on Hopper the NVLink SHARP buffers of ``NCCL_NVLS_ENABLE``);
  issue #31 cites 0.5-1.6 GB per communicator. The upper end on Hopper (NVLS on), the
  lower on Ampere. Every strategy has at least one communicator on more than one rank;
  each further mesh dimension (HSDP's replicate, tensor parallelism) one more.

The allocator's rounding and fragmentation stay a fraction (``margin``, 10%): they
grow with the peak, not with the process.
"""

from __future__ import annotations

import dataclasses

from annot.memory.strategies import MemoryInputError

__all__ = ["DEFAULT_GPU", "GPU_KINDS", "GpuKind", "gpu_kind"]

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class GpuKind:
    """One GPU model: its memory and the per-process reserve terms, in bytes."""

    name: str
    memory: int
    context: int
    cublas: int
    nccl: int

    def reserve(self, communicators: int) -> int:
        """Bytes a training process holds outside its tensors with ``communicators``
        NCCL communicators (0 on one rank)."""
        return self.context + self.cublas + communicators * self.nccl


_HOPPER_CUBLAS = 2 * 32 * MiB
_AMPERE_CUBLAS = 2 * (8 * MiB + 128 * 2**10)
GPU_KINDS: dict[str, GpuKind] = {
    "H100": GpuKind("H100", 81_559 * MiB, 512 * MiB, _HOPPER_CUBLAS, 1536 * MiB),
    "H200": GpuKind("H200", 143_771 * MiB, 512 * MiB, _HOPPER_CUBLAS, 1536 * MiB),
    "A100": GpuKind("A100", 81_920 * MiB, 512 * MiB, _AMPERE_CUBLAS, 512 * MiB),
    "A100-40GB": GpuKind("A100-40GB", 40_960 * MiB, 512 * MiB, _AMPERE_CUBLAS, 512 * MiB),
}
#: The kind assumed when none is named and no GPU is visible.
DEFAULT_GPU = "H100"


def gpu_kind(name: str | None = None, device_name: str | None = None) -> GpuKind:
    """The `GpuKind` named ``name`` (any case), or the one whose name appears in
    ``device_name`` (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3"),
    else `DEFAULT_GPU`'s. An unknown ``name`` is refused listing the kinds."""
    if name is not None:
        for key, kind in GPU_KINDS.items():
            if key.lower() == name.lower():
                return kind
        raise MemoryInputError(f"unknown GPU kind {name!r}; choose from {', '.join(GPU_KINDS)} "
                               "(or give --gpu-mem and --reserve)")
    if device_name is not None:
        upper = device_name.upper()
        if "A100" in upper and "40GB" in upper.replace(" ", ""):
            return GPU_KINDS["A100-40GB"]
        for key in ("H200", "H100", "A100"):
            if key in upper:
                return GPU_KINDS[key]
    return GPU_KINDS[DEFAULT_GPU]
