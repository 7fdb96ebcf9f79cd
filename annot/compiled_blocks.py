"""Compiled blocks: each of a Plan's compile units (`Action.COMPILE`) runs a compiled forward.

`compile_units` is what `annot.auto_wrap` does last, after the engine wrapped the model
and after checkpointing, offload and float8 were put in place, so the compiled region
holds exactly the unit's computation: the engine's hooks around it (FSDP2's all-gather
and reduce-scatter, DDP's) stay eager, and the checkpoint, float8 casts and matmuls
inside it are traced. Each unit's ``forward`` is replaced on the instance by a
`CompiledForward` around the forward it had; parameters, names and state-dict keys are
unchanged, so checkpoints move freely between compiled and eager runs.

A block compiles with ``fullgraph=True`` first. Where dynamo cannot trace it whole (a
graph break), that block falls back to a compile that allows graph breaks; where dynamo
skips the frame (a torch dispatch mode is active, say) or the backend fails, to eager
mode; each with the reason logged once at warning level. `CompiledForward.status` says which, and `compile_report` collects them, with the
graph breaks counted: never silently eager.

Blocks of one class share their compiled code: dynamo treats the module as an input
(``inline_inbuilt_nn_modules``), so a model of 32 identical layers compiles once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["COMPILE_BACKENDS", "CompileOptions", "CompiledForward", "compile_report", "compile_units",
           "is_compiled"]

#: Backends worth naming: ``inductor`` generates kernels (a GPU, or a CPU with a C++
#: compiler); ``aot_eager`` traces forward and backward and runs them with torch's own
#: kernels (any machine: what the CPU tests use); ``eager`` only traces.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

_log = logging.getLogger("annot")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How compile units are compiled: ``torch.compile``'s ``backend``, ``dynamic`` and
    ``mode``; ``fullgraph`` first (then the fallback of the module docstring)."""

    backend: str = "inductor"
    fullgraph: bool = True
    dynamic: bool | None = None
    mode: str | None = None

    @classmethod
    def of(cls, value: bool | str | CompileOptions | None) -> CompileOptions | None:
        """``auto_wrap``'s ``compile=``: ``True`` (defaults), a backend's name, options,
        or ``None``/``False`` (none)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(backend=value)
        if isinstance(value, CompileOptions):
            return value
        raise TypeError(f"compile= takes True, a backend name ({', '.join(COMPILE_BACKENDS)}) or "
                        f"annot.CompileOptions, not {type(value).__name__}")


class CompiledForward:
    """A unit's forward, compiled at its first call as `CompileOptions` say, with the
    fallback of the module docstring. ``status``: ``"pending"`` before the first call,
    then ``"fullgraph"``, ``"graph breaks"`` (fallen back to), ``"graph breaks allowed"``
    (``fullgraph=False`` asked) or ``"eager"``; ``reason`` why it fell back;
    ``graph_breaks`` as dynamo counted them at the first compile of this forward's code."""

    def __init__(self, path: str, forward: Callable[..., Any], options: CompileOptions) -> None:
        self.path = path
        self.original = forward
        self.options = options
        self.status = "pending"
        self.reason = ""
        self.graph_breaks = 0
        self._compiled = self._compile(fullgraph=options.fullgraph)

    def _compile(self, *, fullgraph: bool) -> Callable[..., Any]:
        return torch.compile(self.original, backend=self.options.backend, fullgraph=fullgraph,
                             dynamic=self.options.dynamic, mode=self.options.mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.status != "pending":
            return self._compiled(*args, **kwargs)
        from torch._dynamo.utils import counters

        before = sum(counters["graph_break"].values())
        try:
            # Dynamo traces before it runs anything, so a failed trace leaves nothing done
            # and the call can be made again by the fallback.
            out = self._compiled(*args, **kwargs)
            self.status = "fullgraph" if self.options.fullgraph else "graph breaks allowed"
        except Exception as exc:  # noqa: BLE001 (any trace or backend failure falls back, said)
            out = self._fall_back(exc, args, kwargs)
        found = sum(counters["graph_break"].values()) - before
        # A block of a class compiled before hits dynamo's cache and counts nothing again.
        key = (getattr(getattr(self.original, "__func__", self.original), "__code__", None),
               type(getattr(self.original, "__self__", None)))
        self.graph_breaks = found or _BREAKS.get(key, 0)
        if found:
            _BREAKS[key] = found
        return out

    def _fall_back(self, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Only a graph break (dynamo's ``Unsupported``) is retried, with graph breaks
        allowed; a skipped frame or a backend's failure would run eager or fail again."""
        from torch._dynamo.exc import Unsupported

        self.reason = _reason(exc)
        if self.options.fullgraph and isinstance(exc, Unsupported):
            _log.warning("compile: %s does not compile whole (%s); compiled with graph breaks instead",
                         self.path or "the model", self.reason)
            self._compiled = self._compile(fullgraph=False)
            try:
                out = self._compiled(*args, **kwargs)
                self.status = "graph breaks"
                return out
            except Exception as again:  # noqa: BLE001
                self.reason += f"; then {_reason(again)}"
        _log.warning("compile: %s runs eager: %s", self.path or "the model", self.reason)
        self._compiled = self.original
        self.status = "eager"
        return self.original(*args, **kwargs)


#: Graph breaks dynamo counted at the first compile of each forward's code, by the
#: code and the class of the module it is bound to.
_BREAKS: dict[Any, int] = {}


def _reason(exc: Exception) -> str:
    """The exception's type and its message's first line (and the next, where the first
    only introduces it: a backend's failure "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"


def compile_units(model: nn.Module, paths: list[str], options: CompileOptions) -> list[CompiledForward]:
    """Compile the forward of each module of ``model`` at ``paths`` (in place, see the
    module docstring); returns their `CompiledForward`. Compiling a module twice is an error."""
    done = []
    for path in paths:
        module = model.get_submodule(path)
        if is_compiled(module):
            raise ValueError(f"{path or 'the model'} ({type(module).__name__}) is compiled already")
        compiled = CompiledForward(path, module.forward, options)
        module.forward = compiled
        done.append(compiled)
    return done


def is_compiled(module: nn.Module) -> bool:
    """Whether `compile_units` compiled ``module``'s forward."""
    return isinstance(vars(module).get("forward"), CompiledForward)


def compile_report(model: nn.Module) -> list[CompiledForward]:
    """The `CompiledForward` of every compiled module of ``model``, module order."""
    return [vars(m)["forward"] for m in model.modules() if is_compiled(m)]


def describe(report: list[CompiledForward]) -> str:
    """One line per status: how many blocks, and each fallback's reason."""
    if not report:
        return "compile: no compiled block"
    counts: dict[str, int] = {}
    for c in report:
        counts[c.status] = counts.get(c.status, 0) + 1
    lines = ["compile: " + ", ".join(f"{n} {status}" for status, n in counts.items())
             + f"; {sum(c.graph_breaks for c in report)} graph breaks"]
    lines += [f"  {c.path}: {c.status} ({c.reason})" for c in report if c.reason]
    return "\n".join(lines)
