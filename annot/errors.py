"""Errors raised when a model is handed to an engine the wrong way.

All derive from `annot.AnnotError` (defined in `policies.errors`, so plan errors and
these are caught with one ``except``) and from the builtin that fits, so code that
catches ``RuntimeError``/``ValueError`` keeps working. Each message says what to do.
"""

from __future__ import annotations

from annot.policies.errors import AnnotError

__all__ = [
    "CheckpointError",
    "DeviceNotAvailableError",
    "EngineNotAvailableError",
    "MetaDeviceError",
    "OptimizerOrderError",
    "PolicySelectionError",
    "ProcessGroupNotInitializedError",
]


class ProcessGroupNotInitializedError(AnnotError, RuntimeError):
    """A distributed engine was asked for before ``torch.distributed.init_process_group``."""


class DeviceNotAvailableError(AnnotError, RuntimeError):
    """A device was asked for (``device="cuda"``, an NCCL backend) that this process does not
    see; the message names the device count, the torch build and ``CUDA_VISIBLE_DEVICES``."""


class MetaDeviceError(AnnotError, ValueError):
    """The model still has parameters or buffers on the meta device (no storage)."""


class OptimizerOrderError(AnnotError, RuntimeError):
    """An optimizer already holds the model's parameters, which sharding replaces."""


class EngineNotAvailableError(AnnotError, NotImplementedError):
    """The engine name is known but annot cannot apply a Plan to it (yet)."""


class CheckpointError(AnnotError, ValueError):
    """A checkpoint is missing, malformed, or does not match the model."""


class PolicySelectionError(AnnotError, ValueError):
    """A policy annot handed to another tool (FSDP1's wrap policy, a checkpointing policy)
    selects nothing on the module that tool gave it (docs/design.md, pitfalls 8 and 15)."""
