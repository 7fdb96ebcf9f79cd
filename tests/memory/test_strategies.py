"""Every strategy the planner can recommend is an `auto_wrap` call annot builds: its
printed call, evaluated, reaches the engine's own options and check step unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import annot
from annot.engines.base import WrapRequest
from annot.engines.registry import get_engine
from annot.memory import PRECISIONS, STRATEGIES
from annot.memory.report import PREFERENCE
from examples.gpt.model import GPT


class _Recorder:
    """Stands in for the ``annot`` module when evaluating a printed call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def auto_wrap(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def _evaluate(call: str, model: torch.nn.Module) -> tuple[str, dict[str, Any]]:
    code = call.split(" + torch.autocast")[0]  # the autocast note is prose, not code
    recorder = _Recorder()
    fake_model = _Model(model)
    exec(code, {"annot": recorder, "model": fake_model, "torch": torch,
                "make_optimizer": torch.optim.AdamW})
    (args, kwargs), = recorder.calls
    assert args[0] is fake_model
    return args[1], kwargs


class _Model:
    """``model.to(dtype)`` in a printed call must not touch the real model here."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def to(self, dtype: torch.dtype) -> None:
        assert dtype is torch.bfloat16


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("chosen", STRATEGIES, ids=lambda s: s.key)
def test_every_strategy_call_passes_the_engines_own_checks(chosen, precision):
    model = GPT(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    engine_name, kwargs = _evaluate(chosen.call(precision, checkpoint=True), model)
    assert engine_name == chosen.engine
    assert kwargs.pop("checkpoint") is True
    assert (kwargs.pop("optimizer", None) is not None) == (chosen.engine == "deepspeed")
    engine = get_engine(engine_name)
    options = engine.options(None, **kwargs)
    # The check step as auto_wrap runs it, on a GPU device (FSDP1 offload needs one;
    # nothing is allocated).
    request = WrapRequest(annot.plan(model), torch.device("cuda"), deferred=False)
    engine.check(model, request, options)
    if chosen.engine == "deepspeed":
        zero = engine.config["zero_optimization"]  # the config DeepSpeed would get
        assert zero["stage"] == chosen.stage
        assert ("offload_optimizer" in zero) == (chosen.offload_optimizer is not None)
        assert ("offload_param" in zero) == chosen.offload_params
        assert ("bf16" in engine.config) == (precision in ("bf16-mixed", "bf16"))
    elif chosen.engine == "ddp":
        assert chosen.stage == 0 and not chosen.offload_params
    else:
        assert bool(options.offload) == chosen.offload_params
        assert options.reshard_after_forward == (chosen.stage == 3)


def test_every_preferred_key_is_a_strategy():
    keys = {s.key for s in STRATEGIES}
    assert {key for key, _ in PREFERENCE} <= keys
