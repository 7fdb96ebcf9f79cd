"""Each rank's random number generators as JSON data, for `annot.save_state` /
`annot.load_state`: torch's CPU generator, every CUDA device's, Python's, NumPy's (when
NumPy is imported) and the states DeepSpeed's model-parallel RNG tracker keeps
(``deepspeed.checkpointing.get_cuda_rng_tracker()``, when it tracks any).

A resumed run may see fewer or more CUDA devices than the one that saved (another
``CUDA_VISIBLE_DEVICES``, a smaller node): the saved states are restored onto the
devices both have, and what is left over is logged by device index.
"""

from __future__ import annotations

import base64
import importlib
import logging
import random
import sys
from typing import Any

import torch

from annot.process_group import rank_and_world

__all__ = ["rng_states", "set_rng_states"]

_log = logging.getLogger("annot")

# Where DeepSpeed keeps the tracker (``deepspeed.checkpointing`` re-exports it).
_DEEPSPEED_CHECKPOINTING = "deepspeed.runtime.activation_checkpointing.checkpointing"


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _deepspeed_tracker(import_it: bool = False) -> Any:
    """DeepSpeed's model-parallel RNG tracker if DeepSpeed is loaded (or ``import_it``),
    else ``None``. A process that never imported DeepSpeed has no tracker states to save,
    and importing it only to find none would cost seconds."""
    module = sys.modules.get(_DEEPSPEED_CHECKPOINTING)
    if module is None and import_it:
        try:
            module = importlib.import_module(_DEEPSPEED_CHECKPOINTING)
        except ImportError:
            return None
    return None if module is None else module.get_cuda_rng_tracker()


def rng_states() -> dict[str, Any]:
    """This process's RNG states as JSON data.

    CUDA's are saved whenever CUDA is available, one per visible device, even before
    anything initialised CUDA (reading them initialises it): a run whose first CUDA
    operation comes after the save still draws from those generators later.
    """
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"torch": _bytes(torch.get_rng_state()),
                           "python": [version, list(state), gauss]}
    if torch.cuda.is_available():
        out["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    tracker = _deepspeed_tracker()
    tracked = tracker.get_states() if tracker is not None else {}
    if tracked:
        out["deepspeed_tracker"] = {name: _bytes(s) for name, s in tracked.items()}
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned. CUDA states go onto the first
    ``min(saved, visible)`` devices; states of devices not visible here are dropped and
    devices the save did not know keep theirs, each logged with the device indices."""
    torch.set_rng_state(_tensor(states["torch"]))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    if "cuda" in states:
        _set_cuda_states(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if "deepspeed_tracker" in states:
        _set_tracker_states(states["deepspeed_tracker"])


def _set_cuda_states(saved: list[str]) -> None:
    rank = rank_and_world()[0]
    if not torch.cuda.is_available():
        _log.warning("rank %d: the CUDA RNG states of %d device(s) were saved, but CUDA is not "
                     "available here: not restored", rank, len(saved))
        return
    visible = torch.cuda.device_count()
    kept = min(len(saved), visible)
    for device in range(kept):
        torch.cuda.set_rng_state(_tensor(saved[device]), device)
    if len(saved) > visible:
        _log.warning("rank %d: CUDA RNG states of devices %s dropped: saved on %d devices, %d "
                     "visible here (devices 0-%d restored)", rank, _indices(kept, len(saved)),
                     len(saved), visible, kept - 1)
    elif visible > len(saved):
        _log.warning("rank %d: CUDA devices %s keep their current RNG state: the save knew %d "
                     "device(s), %d are visible here", rank, _indices(kept, visible), len(saved),
                     visible)


def _indices(start: int, stop: int) -> str:
    return ", ".join(str(i) for i in range(start, stop))


def _set_tracker_states(saved: dict[str, str]) -> None:
    tracker = _deepspeed_tracker(import_it=True)
    if tracker is None:
        _log.warning("DeepSpeed model-parallel RNG tracker states %s were saved, but DeepSpeed "
                     "is not installed here: not restored", ", ".join(sorted(saved)))
        return
    tracker.set_states({name: _tensor(s) for name, s in saved.items()})
