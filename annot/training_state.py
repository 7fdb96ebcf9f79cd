"""`annot.save_state` / `annot.load_state`: checkpoint and resume whole training runs.

A training state is one folder per save, ``DIR/step-00000042``, holding:

- a torch distributed checkpoint (DCP: ``.metadata`` and each rank's ``.distcp`` files)
  of the model and optimizer state in torch's layout (``model.<name>``,
  ``optim.state.<name>.<key>``, names as in the bare model; `annot.engines.
  training_state`), each rank writing and reading only its pieces, so it loads on any
  world size and into any engine annot wraps;
- ``trainer_state.json``: the step, the optimizer's param groups, the scheduler's state,
  the user's ``extra``, the engine and world size that wrote it, engine counters, the
  fp16 loss scaler's state (scale, growth tracker, skipped steps);
- ``rng-rank00000.json``, one per rank: that rank's random number generator states
  (`annot.engines.rng_state`: CPU, each CUDA device, Python, NumPy, DeepSpeed's
  model-parallel tracker);
- ``data-rank00000.json``, one per rank, when ``data=`` was passed: the position in the
  data (the ``state_dict()`` of the loader or sampler given, `annot.ResumableLoader`'s
  being the same on every rank and so valid on any world size);
- ``COMMITTED``, written last (`annot.checkpoint_io.commit`): a folder without it is an
  interrupted save, refused with what it lacks.

Everything but the tensors is JSON, so nothing is unpickled but DCP's own metadata,
and that through an allowlist, for folders annot committed (docs/design.md, pitfall 17).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from annot.checkpoint_io import commit
from annot.checkpoint_io.dcp_metadata import SafeFileSystemReader, read_metadata
from annot.engines.base import EngineState, Trainable
from annot.engines.registry import ENGINES, get_engine
from annot.engines.rng_state import rng_states, set_rng_states
from annot.engines.training_state import TorchState
from annot.errors import CheckpointError
from annot.process_group import barrier, long_collectives, rank_and_world
from annot.quantized_tensors import is_quantized, quantization_of

__all__ = ["PendingSave", "ResumedState", "committed_states", "finish_pending_saves", "latest_state", "load_state",
           "save_state"]

FORMAT = "annot-training-state"
VERSION = 1
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_log = logging.getLogger("annot")


@dataclasses.dataclass(frozen=True)
class ResumedState:
    """What `load_state` restored besides the model and optimizer."""

    path: Path
    step: int
    extra: dict[str, Any]
    #: The world size and engine that wrote the state.
    saved_world_size: int
    saved_engine: str
    #: Whether this rank's RNG states were restored (same world size only).
    rng_restored: bool


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.json"


def _data_file(rank: int) -> str:
    return f"data-rank{rank:05d}.json"


def _require_stateful(data: Any, call: str) -> None:
    if not (callable(getattr(data, "state_dict", None))
            and callable(getattr(data, "load_state_dict", None))):
        raise TypeError(f"{call}(data=...) takes an object with state_dict() and load_state_dict() "
                        f"(annot.ResumableLoader, a stateful loader or sampler), not "
                        f"{type(data).__name__}; keep other JSON data in extra=")


def step_folder(directory: str | os.PathLike[str], step: int) -> Path:
    """Where `save_state` puts ``step`` under ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def _json_checked(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON data (numbers, strings, lists, dicts): {exc}; "
                              "keep tensors in the model or optimizer") from None


def engine_state(trainable: Trainable) -> EngineState:
    """The `EngineState` ``trainable``'s engine saves and loads with (`Engine.state`); a
    `Trainable` of the user's own making (a plain module, engine ``"local"``) goes
    through torch's state-dict API, which reads such a module as it is."""
    if trainable.engine not in ENGINES:
        return TorchState(trainable)
    return get_engine(trainable.engine).state(trainable)


# -- save ----------------------------------------------------------------------------------
@dataclasses.dataclass
class PendingSave:
    """An asynchronous save whose files are being written in the background. `wait`
    (collective: every rank calls it) finishes it and commits; the next `save_state`
    and `load_state` do so first by themselves."""

    future: Any
    staging: Path
    final: Path
    directory: Path
    info: dict[str, Any]
    keep_last: int | None
    #: When `save_state` began (``time.perf_counter``), and how long it held training.
    started: float = 0.0
    blocked_s: float = 0.0
    #: Seconds from the start until the background write finished (``None`` before).
    written_s: float | None = None
    done: bool = False

    def wait(self) -> Path:
        if not self.done:
            self.done = True
            self.future.result()
            with long_collectives():
                _finish(self.staging, self.final, self.directory, self.info, self.keep_last)
            _log_cost(self.final, self.blocked_s, time.perf_counter() - self.started, written=self.written_s)
        return self.final


_pending: list[PendingSave] = []
_async_group: list[Any] = []


def finish_pending_saves() -> None:
    """Write and commit every asynchronous save still pending (`PendingSave.wait` of
    each, which lifts a short collective bound for the commit). Collective. A run that
    ends with one pending must call it (`annot.Interruptions` does when its block ends),
    or that save stays an uncommitted staging folder; the next `save_state` and
    `load_state` call it first."""
    while _pending:
        _pending.pop().wait()


def save_state(directory: str | os.PathLike[str], trainable: Trainable, *, step: int,
               scheduler: Any = None, extra: dict[str, Any] | None = None,
               data: Any = None, keep_last: int | None = None,
               async_save: bool | str = False) -> Path | PendingSave:
    """Save ``trainable``'s whole training state to ``directory/step-<step>``.

    Collective: every rank calls it and writes only its own pieces. ``scheduler``: an LR
    scheduler (anything with ``state_dict``), ``extra``: JSON data of your own (metrics),
    returned by `load_state`. ``data``: where the run is in its data, an object with
    ``state_dict()`` / ``load_state_dict()`` whose state is JSON (`annot.ResumableLoader`,
    whose position is global and so resumes on any world size); each rank's is saved.
    ``keep_last=K`` deletes all but the K newest committed states under ``directory``
    after this one is committed.
    ``async_save=True`` (or ``"thread"``) returns once the tensors are copied
    (``dcp.async_save``) and writes them from a thread; ``async_save="process"`` copies
    them into shared memory (pinned on CUDA) and writes them from torch's checkpoint
    process (spawned once: the script's entry point must sit under ``if __name__ ==
    "__main__":``, which the spawned process imports). The returned `PendingSave`
    commits on ``wait()``, at the next `save_state`, or with `finish_pending_saves`.
    Returns the committed folder (or the pending save).
    """
    if async_save not in (False, True, "thread", "process"):
        raise ValueError(f"async_save takes False, True, 'thread' or 'process', not {async_save!r}")
    if not isinstance(trainable, Trainable):
        raise TypeError(f"save_state takes the Trainable auto_wrap(..., optimizer=...) returns, "
                        f"not {type(trainable).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    if data is not None:
        _require_stateful(data, "save_state")
    started = time.perf_counter()
    with long_collectives():
        return _save_state(Path(directory), trainable, step=step, scheduler=scheduler, extra=extra,
                           data=data, keep_last=keep_last, async_save=async_save, started=started)


def _save_state(directory: Path, trainable: Trainable, *, step: int, scheduler: Any,
                extra: dict[str, Any] | None, data: Any, keep_last: int | None, async_save: bool | str,
                started: float) -> Path | PendingSave:
    finish_pending_saves()
    import torch.distributed.checkpoint as dcp

    rank, world = rank_and_world()
    final = step_folder(directory, step)
    state, groups, counters = engine_state(trainable).save_dict()
    info = {
        "format": FORMAT, "version": VERSION, "step": int(step), "engine": trainable.engine,
        "world_size": world, "param_groups": groups, "engine_state": counters,
        "scheduler": _json_checked(scheduler.state_dict(), "the scheduler's state")
        if scheduler is not None else None,
        "extra": _json_checked(extra or {}, "extra"),
        # fp16 loss scaling: the scale and the skipped steps (None without a scaler).
        "loss_scaler": _json_checked(trainable.loss_scaler_state(), "the loss scaler's state"),
        "quantized_base": quantized_base(trainable.model),
    }
    data_state = (_json_checked(data.state_dict(), f"the data position ({type(data).__name__})")
                  if data is not None else None)
    info["data"] = data is not None
    expected = [".metadata", STATE_FILE, *(_rng_file(r) for r in range(world)),
                *((_data_file(r) for r in range(world)) if data is not None else ())]
    # A save that fails or is killed leaves its staging folder as it is: never in the
    # way (the next save clears it, loading skips it) and refused if named explicitly.
    staging = commit.begin(final, {"files": expected, "step": int(step), "world_size": world})
    commit.write_json(staging / _rng_file(rank), rng_states())
    if data is not None:
        commit.write_json(staging / _data_file(rank), data_state)
    writer = dcp.FileSystemWriter(str(staging))
    if async_save:
        future = dcp.async_save(state, storage_writer=writer, process_group=_background_group(),
                                **(_in_a_process() if async_save == "process" else {}))
        pending = PendingSave(future, staging, final, directory, info, keep_last, started=started,
                              blocked_s=time.perf_counter() - started)
        future.add_done_callback(  # type: ignore[union-attr]  # a Future: no stager given
            lambda _: setattr(pending, "written_s", time.perf_counter() - started))
        _pending.append(pending)
        return pending
    dcp.save(state, storage_writer=writer)
    _finish(staging, final, directory, info, keep_last)
    seconds = time.perf_counter() - started
    _log_cost(final, seconds, seconds)
    return final


def _log_cost(final: Path, blocked: float, total: float, *, written: float | None = None) -> None:
    """What a save cost: how long it held training, and how long until it was committed
    (rank 0; the figures to choose a save interval by, docs/guides/interruptions.md).
    ``written``: an asynchronous save's seconds until its background write finished (it
    is committed at the next save or `finish_pending_saves`)."""
    if rank_and_world()[0] == 0:
        background = "" if written is None else f", written in the background in {written:.2f} s"
        _log.info("saved %s: training blocked %.2f s%s, committed after %.2f s", final.name, blocked,
                  background, total)


def _in_a_process() -> dict[str, Any]:
    """``dcp.async_save``'s options for torch's checkpoint process: the tensors staged
    into shared memory (pinned where CUDA is), synchronously, so training may change them
    as soon as `save_state` returns."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = torch.cuda.is_available()
    return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS,
            "async_stager": DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                         use_async_staging=False, use_non_blocking_copy=False))}


def _background_group() -> Any:
    """A gloo group of its own for background saves, so their collectives never meet
    the training's (torch's advice for ``dcp.async_save``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if not _async_group:
        _async_group.append(torch.distributed.new_group(backend="gloo"))
    return _async_group[0]


def _finish(staging: Path, final: Path, directory: Path, info: dict[str, Any],
            keep_last: int | None) -> None:
    if rank_and_world()[0] == 0:
        commit.write_json(staging / STATE_FILE, info)
    commit.commit(staging, final, {"format": FORMAT, "step": info["step"]})
    if keep_last is not None and rank_and_world()[0] == 0:
        for old in committed_states(directory)[:-keep_last]:
            shutil.rmtree(old)
    barrier()


# -- load ----------------------------------------------------------------------------------
def committed_states(directory: str | os.PathLike[str]) -> list[Path]:
    """Committed step folders under ``directory``, oldest first."""
    directory = Path(directory)
    found = []
    for child in directory.iterdir() if directory.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and commit.is_committed(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_state(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed state under ``directory`` (None if there is none)."""
    found = committed_states(directory)
    return found[-1] if found else None


def _resolve(directory: Path) -> Path:
    """``directory`` itself if it is one save (committed or not), else its newest
    committed save; interrupted saves beside it are logged."""
    if (directory / commit.MARKER).exists() or (directory / commit.PLAN).exists():
        return directory
    latest = latest_state(directory)
    partial = [p.name for p in directory.glob(".step-*.partial")] if directory.is_dir() else []
    if latest is None:
        raise CheckpointError(
            f"{directory}: no committed training state (no step-*/{commit.MARKER})"
            + (f"; interrupted saves: {', '.join(sorted(partial))}" if partial else ""))
    if partial:
        _log.warning("%s: ignoring interrupted saves %s; resuming from %s", directory,
                     ", ".join(sorted(partial)), latest.name)
    return latest


def load_state(directory: str | os.PathLike[str], trainable: Trainable, *,
               scheduler: Any = None, data: Any = None, strict: bool = True) -> ResumedState:
    """Restore ``trainable`` (model, optimizer), ``scheduler`` and this rank's RNG states
    from a state `save_state` wrote, on any world size and engine.

    ``directory``: one save (``DIR/step-...``) or the folder holding them (the newest
    committed one is taken). An interrupted save is refused with what it lacks.
    Collective. RNG states come back only on the world size that saved them (each rank
    its own); elsewhere they are left as they are and logged. ``strict=False`` lets
    keys the checkpoint lacks keep their current values (listed in the log).
    ``data``: the loader or sampler `save_state` got as ``data=`` (rebuilt the same way),
    put back where the run was. Each rank reads its own position on the world size that
    saved it; on another world size the saved positions must all be equal (a global
    position, as `annot.ResumableLoader`'s), else the load is refused.
    """
    if not isinstance(trainable, Trainable):
        raise TypeError(f"load_state takes the Trainable auto_wrap(..., optimizer=...) returns, "
                        f"not {type(trainable).__name__}")
    if data is not None:
        _require_stateful(data, "load_state")
    with long_collectives():
        return _load_state(Path(directory), trainable, scheduler=scheduler, data=data, strict=strict)


def _load_state(directory: Path, trainable: Trainable, *, scheduler: Any, data: Any,
                strict: bool) -> ResumedState:
    finish_pending_saves()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path = _resolve(directory)
    commit.require_committed(path)
    info = json.loads((path / STATE_FILE).read_text())
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise CheckpointError(f"{path / STATE_FILE}: format {info.get('format')!r} version "
                              f"{info.get('version')!r}, this annot reads {FORMAT!r} {VERSION}")
    _check_quantized_base(path, info.get("quantized_base"), quantized_base(trainable.model))
    if data is not None:  # first: a loader built for another order fails before the load
        data.load_state_dict(_data_state(path, info))
    metadata = read_metadata(path)
    keys = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    _check_coverage(path, keys)
    missing: set[str] = set()

    def read(state: dict[str, Any]) -> None:
        wanted = _flat_keys(state)
        absent = sorted(wanted - set(keys))
        if absent and strict:
            raise CheckpointError(
                f"{path} lacks {len(absent)} of this model's keys: {', '.join(absent[:8])}"
                f"{' ...' if len(absent) > 8 else ''} (pass strict=False to keep their values)")
        missing.update(absent)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)),
                 planner=DefaultLoadPlanner(allow_partial_load=not strict))

    engine_state(trainable).load(read, keys, info["param_groups"], info.get("engine_state") or {})
    if missing:
        _log.warning("%s: kept the current values of %s (not in the checkpoint)", path,
                     ", ".join(sorted(missing)[:8]))
    trainable.load_loss_scaler_state(info.get("loss_scaler"), str(path))
    if scheduler is not None:
        if info.get("scheduler") is None:
            raise CheckpointError(f"{path} holds no scheduler state, but a scheduler was passed")
        scheduler.load_state_dict(info["scheduler"])
    rank, world = rank_and_world()
    same_world = info["world_size"] == world
    if same_world:
        set_rng_states(json.loads((path / _rng_file(rank)).read_text()))
    elif rank == 0:
        _log.warning("%s was saved on %d ranks and is loaded on %d: random number generators "
                     "are not restored", path, info["world_size"], world)
    return ResumedState(path, int(info["step"]), info.get("extra") or {}, int(info["world_size"]),
                        str(info["engine"]), same_world)


def _data_state(path: Path, info: dict[str, Any]) -> Any:
    """This rank's saved data position: its own on the world size that saved it, else the
    one position every saving rank recorded (refused when they differ)."""
    if not info.get("data"):
        raise CheckpointError(f"{path} holds no data position (saved without data=), but "
                              "load_state got data=; leave it out to start the data afresh")
    rank, world = rank_and_world()
    if info["world_size"] == world:
        return json.loads((path / _data_file(rank)).read_text())
    states = [json.loads((path / _data_file(r)).read_text()) for r in range(info["world_size"])]
    if any(state != states[0] for state in states[1:]):
        raise CheckpointError(
            f"{path}: the data positions of the {info['world_size']} saving ranks differ, so "
            f"they cannot be spread over {world} ranks; resume on {info['world_size']} ranks, or "
            "use a loader whose position is global (annot.ResumableLoader)")
    return states[0]


def quantized_base(model: torch.nn.Module) -> dict[str, Any] | None:
    """The quantized weights of ``model`` (a QLoRA base) and the settings they were made
    with, as JSON data, or None when it has none. Those weights are not saved (the
    engines' states leave them out): a resumed run rebuilds its base from the model's
    checkpoint, so it must quantize the same weights the same way."""
    # Parameters, not state_dict(): an FSDP1 unit's state_dict() would start the
    # engine's lazy setup with that unit as its root.
    weights = {name: quantization_of(tensor) for name, tensor in model.named_parameters()
               if is_quantized(tensor)}
    if not weights:
        return None
    settings = next(iter(weights.values()))
    if any(value != settings for value in weights.values()):
        raise CheckpointError("the quantized weights of this model differ in their settings: "
                              + ", ".join(sorted({json.dumps(v, sort_keys=True) for v in weights.values()})))
    return {**settings, "weights": sorted(weights)}


def _check_quantized_base(path: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse to resume a run whose base was quantized otherwise than this model's: its
    adapters were trained against other weights."""
    if saved == current:
        return
    if saved is None or current is None:
        raise CheckpointError(
            f"{path} was saved from a model {'with' if current is None else 'without'} a quantized "
            f"base, and this model has {'none' if current is None else 'one'}: build it as the "
            "saving run did (the same quantize= of annot.from_pretrained)")
    differ = [key for key in sorted(saved.keys() | current.keys())
              if key != "weights" and saved.get(key) != current.get(key)]
    saved_names, names = set(saved.get("weights", ())), set(current.get("weights", ()))
    detail = [f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}" for key in differ]
    if saved_names != names:
        detail.append(f"quantized weights: {len(saved_names - names)} only in the saved run "
                      f"({', '.join(sorted(saved_names - names)[:3])}), {len(names - saved_names)} "
                      f"only in this one ({', '.join(sorted(names - saved_names)[:3])})")
    raise CheckpointError(f"{path}: the quantized base differs from this model's ({'; '.join(detail)}): "
                          "resume with the saving run's model, dtype and quantize= settings")


def _flat_keys(state: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in state.items():
        if isinstance(value, dict):
            out |= _flat_keys(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def _check_coverage(path: Path, keys: dict[str, Any]) -> None:
    """Every saved tensor's chunks cover it whole (a save that lost a rank's pieces
    would otherwise load zeros there)."""
    import math

    for key, meta in keys.items():
        covered = sum(math.prod(chunk.sizes) for chunk in meta.chunks)
        if covered != math.prod(meta.size):
            raise CheckpointError(f"{path}: {key} has {covered} of its {math.prod(meta.size)} "
                                  "elements: the checkpoint is damaged")
