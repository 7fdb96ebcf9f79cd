"""ZeRO-Offload's optimizer step: DeepSpeed's CPU Adam in place of torch's Adam/AdamW.

With the optimizer state offloaded (``offload_optimizer`` in the config), the step runs
on the host over fp32 partitions, and the GPUs wait for it every step. torch's Adam and
AdamW step there element by element through generic kernels; DeepSpeed's
``DeepSpeedCPUAdam`` is a vectorised C++ kernel (DeepSpeed's docstring: 5-7x faster),
compiled on first use (``CPUAdamBuilder``, a JIT build into ``TORCH_EXTENSIONS_DIR``,
minutes once per machine) unless the DeepSpeed install ships it prebuilt. DeepSpeed
refuses a client optimizer under offload unless ``zero_force_ds_cpu_optimizer`` is off,
which annot's config turns off so that any optimizer trains; this module puts CPU Adam
back where it can (issue #30).

`host_optimizer_factory` wraps the user's factory: what it returns is kept unless it is
exactly torch's ``Adam`` or ``AdamW`` (a subclass may step differently) with settings
CPU Adam has (no ``amsgrad``, ``maximize``); then its param groups, every key kept,
become a ``DeepSpeedCPUAdam`` (``adamw_mode`` for ``AdamW`` or decoupled weight decay).
``cpu_adam``: ``None`` swaps where DeepSpeed's accelerator is a GPU (the CPU accelerator
runs everything on the host anyway, and a JIT build there costs minutes for no GPU
waiting), and warns, naming the cost, when the kernel cannot be built; ``True`` swaps on
any accelerator and raises when it cannot; ``False`` keeps the torch optimizer.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from annot.engines.base import OptimizerFactory
from annot.errors import EngineNotAvailableError

__all__ = ["cpu_adam_class", "host_optimizer_factory", "offloads_optimizer"]

_log = logging.getLogger(__name__)


def offloads_optimizer(config: dict[str, Any]) -> bool:
    """Whether the DeepSpeed config keeps the optimizer state on the host (CPU or NVMe:
    both step it on the CPU)."""
    offload = config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device") in ("cpu", "nvme")


def cpu_adam_class() -> type[torch.optim.Optimizer]:
    """``DeepSpeedCPUAdam`` with its kernel loaded: builds it (JIT) when it is not yet.
    Raises what the build raises."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if not builder.is_compatible():
        raise RuntimeError(f"DeepSpeed's {builder.name} is not compatible with this system")
    builder.load()  # the JIT build, or the prebuilt op; cached for the process
    return DeepSpeedCPUAdam


def _translatable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why CPU Adam cannot take ``optimizer``'s place (``None``: it can)."""
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                return f"{flag}=True, which DeepSpeed's CPU Adam does not implement"
    return None


def _as_cpu_adam(optimizer: torch.optim.Optimizer, cls: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.param_groups[0].get("decoupled_weight_decay"))
    groups = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        groups.append({**group, "lr": float(lr) if isinstance(lr, torch.Tensor) else lr,
                       "bias_correction": True})
    return cls(groups, adamw_mode=adamw)  # type: ignore[call-arg]


def _swap(optimizer: torch.optim.Optimizer, choice: bool | None, on_gpu: bool,
          load: Callable[[], type[torch.optim.Optimizer]]) -> torch.optim.Optimizer:
    name = type(optimizer).__name__
    if choice is False or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    if choice is None and not on_gpu:
        _log.info("ZeRO-Offload on DeepSpeed's CPU accelerator keeps torch's %s "
                  "(cpu_adam=True builds DeepSpeed's CPU Adam)", name)
        return optimizer
    reason = _translatable(optimizer)
    if reason is None:
        try:
            return _as_cpu_adam(optimizer, load())
        except Exception as error:  # a failed build: compiler, headers, CPU flags
            reason = f"it could not be built ({type(error).__name__}: {error})"
    if choice:
        raise EngineNotAvailableError(
            f"cpu_adam=True: DeepSpeed's CPU Adam cannot replace torch's {name}: {reason}. "
            "Pass cpu_adam=None to fall back to the torch optimizer with a warning")
    warnings.warn(
        f"ZeRO-Offload steps torch's {name} on the host, because DeepSpeed's CPU Adam "
        f"cannot replace it: {reason}. The host step is several times slower (DeepSpeed "
        "measures 5-7x for its kernel) and every GPU waits for it each step. Install a C++ "
        "compiler (DeepSpeed builds the kernel on first use), or a DeepSpeed built with "
        "DS_BUILD_CPU_ADAM=1; cpu_adam=False keeps torch's optimizer without this warning.",
        stacklevel=2)
    return optimizer


def host_optimizer_factory(factory: OptimizerFactory, config: dict[str, Any], *,
                           choice: bool | None, on_gpu: bool,
                           load: Callable[[], type[torch.optim.Optimizer]] = cpu_adam_class,
                           ) -> OptimizerFactory:
    """``factory``, or, when ``config`` offloads the optimizer state, a factory that
    returns DeepSpeed's CPU Adam in place of torch's Adam/AdamW (see the module
    docstring for ``choice``). ``on_gpu``: DeepSpeed's accelerator is a GPU. ``load``
    gives the CPU Adam class (tests pass their own)."""
    if not offloads_optimizer(config):
        return factory

    def build(params: Any) -> torch.optim.Optimizer:
        return _swap(factory(params), choice, on_gpu, load)

    return build
