"""What every row shares: the device, what was found about CUDA, the process group.

The rows run in one process as rank 0 of a world of one, on the device and backend
`annot.devices` chooses for any training job (`annot.init_distributed`): NCCL for CUDA
tensors with gloo beside it for CPU ones on a GPU, gloo on the CPU. A row that needs a
different group (torch's fake one, world 8) swaps it with `Context.fake_group` and the
world-one group comes back afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist

from annot.devices import distributed_backend
from annot.process_group import init_distributed

__all__ = ["Context", "cuda_found"]


def cuda_found() -> str:
    """What this torch says about CUDA, for a skip reason."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"torch {torch.__version__}, built with CUDA {torch.version.cuda}, {count} device(s)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class Context:
    """The device the rows run on and helpers they share."""

    device: torch.device
    seed: int = 0
    # Whether this process chose the rendezvous port (not launched by torchrun): then
    # every new group gets a fresh one, as a destroyed group's store may still hold it.
    _own_port: bool | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def missing(self, *modules: str) -> list[str]:
        """Which of ``modules`` are not installed."""
        return [m for m in modules if importlib.util.find_spec(m) is None]

    def backend(self) -> str:
        """The process-group backend of the world-one group (`distributed_backend`)."""
        return distributed_backend(self.device)

    def start_group(self) -> None:
        """The world-one process group (and the environment torchrun would have set)."""
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if self._own_port is None:
            self._own_port = "MASTER_PORT" not in os.environ
        if self._own_port:
            os.environ["MASTER_PORT"] = str(_free_port())
        # The device made current and the group joined as a training job's are.
        init_distributed(self.backend(), device=self.device, heartbeat=False)

    def stop_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextlib.contextmanager
    def fake_group(self, world: int) -> Iterator[None]:
        """torch's fake process group of ``world`` ranks (collectives do nothing; tensors
        are real) in place of the world-one group, which is back afterwards."""
        from torch.testing._internal.distributed.fake_pg import FakeStore

        self.stop_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            yield
        finally:
            dist.destroy_process_group()
            self.start_group()

    def fresh(self) -> None:
        """Between rows: free what the last one left and restart the peak counters."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
