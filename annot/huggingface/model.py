"""Recognising transformers models, choosing the class a config builds, and the
training adjustments `annot.auto_wrap` makes to a ``PreTrainedModel``.

`prepare_for_training` is what `auto_wrap` does to a ``PreTrainedModel`` before
checkpointing it: transformers' own activation checkpointing is turned off when annot
checkpoints (recomputation is never stacked), and ``use_cache`` is turned off whenever
either checkpoints (a key/value cache is useless in training and transformers refuses it
with checkpointing). Both are logged.

transformers is imported inside the functions: ``import annot`` stays light.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from annot._deprecation import warn_deprecated
from annot.module_state import module_state

__all__ = [
    "AUTO_CLASS_ORDER",
    "COMPUTES_OUTSIDE_FORWARD",
    "cache_off_in_training",
    "computes_outside_forward",
    "is_diffusers_model",
    "keep_output_capturing",
    "is_peft_model",
    "is_pretrained_model",
    "keep_in_fp32_names",
    "model_factory",
    "prepare_for_training",
    "pretrained_inside",
    "training_forward_kwargs",
]

logger = logging.getLogger("annot.huggingface")

# Tried in this order when neither ``auto_class=`` nor the config's ``architectures``
# names a class transformers has: the head a training script most likely wants first.
AUTO_CLASS_ORDER = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
    "AutoModel",
)


def is_pretrained_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``, recognised by attribute (no import)."""
    return hasattr(model, "config") and hasattr(type(model), "_no_split_modules") and hasattr(
        model, "post_init")


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT ``PeftModel``, recognised by attribute (no import)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def pretrained_inside(model: nn.Module) -> nn.Module | None:
    """The transformers model ``model`` is or wraps (a PEFT ``PeftModel``, a user's
    module holding one): the outermost ``PreTrainedModel`` in its tree, or ``None``."""
    for module in model.modules():
        if is_pretrained_model(module):
            return module
    return None


def model_factory(config: Any, auto_class: type | str | None = None,
                  trust_remote_code: bool = False) -> Callable[..., nn.Module]:
    """``factory(config, dtype=...)`` building the model class for ``config``: the one
    choice of class for `annot.from_pretrained` and ``annot plan DIR``.

    ``auto_class`` if given (a class or a transformers name); else the first class the
    config's ``architectures`` names that transformers has (``save_pretrained`` writes
    it, so a directory builds as the class that saved it); else the first of
    `AUTO_CLASS_ORDER` that knows the config."""
    import transformers

    if isinstance(auto_class, str):
        found = getattr(transformers, auto_class, None)
        if found is None:
            raise ValueError(f"auto_class={auto_class!r}: transformers has no such class")
        auto_class = found
    if auto_class is None:
        for name in getattr(config, "architectures", None) or ():
            concrete = getattr(transformers, name, None)
            if isinstance(concrete, type) and hasattr(concrete, "_from_config"):
                auto_class = concrete
                break
    if auto_class is None:
        for name in AUTO_CLASS_ORDER:
            candidate = getattr(transformers, name)
            if type(config) in candidate._model_mapping or (
                    trust_remote_code and name in (getattr(config, "auto_map", None) or {})):
                auto_class = candidate
                break
        else:
            raise ValueError(
                f"no transformers auto class knows {type(config).__name__}: pass auto_class=")
    # The transformers class chosen: an Auto* class (from_config) or a model class
    # (_from_config), which the `type` of the signature does not describe.
    chosen: Any = auto_class
    if hasattr(chosen, "_model_mapping"):  # an Auto* class
        return lambda cfg, dtype: chosen.from_config(cfg, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    return lambda cfg, dtype: chosen._from_config(cfg, dtype=dtype)


def keep_in_fp32_names(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Paths of the modules transformers keeps in float32 when loading in ``dtype``:
    ``_keep_in_fp32_modules`` for float16, plus ``_keep_in_fp32_modules_strict`` for
    float16 and bfloat16 (transformers 5's rule). A name matches a module whose path has
    it as a component."""
    from annot.policies.rules import declared_names, modules_named

    names = declared_names(model, "_keep_in_fp32_modules_strict") if dtype in (
        torch.float16, torch.bfloat16) else []
    if dtype == torch.float16:
        names += [n for n in declared_names(model, "_keep_in_fp32_modules") if n not in names]
    return modules_named(model, names) if names else []


def prepare_for_training(model: nn.Module, *, checkpointing: bool) -> list[str]:
    """Adjust the transformers model ``model`` is or holds (`pretrained_inside`: bare,
    inside PEFT or inside a module of the user's) for training; returns what was changed,
    in words (each also logged on the ``annot.huggingface`` logger), nothing for a model
    without one.

    ``checkpointing``: whether annot checkpoints some of its units. If so and
    transformers' own activation checkpointing is on, it is turned off (annot's runs
    inside the engine's units). If not, transformers' stays and is what checkpoints.
    Either way, when something checkpoints, training forwards run with
    ``use_cache=False`` (recomputation would append to a key/value cache a second time:
    docs/design.md, pitfall 14). The configs are left as they are, so a model saved later
    keeps the user's ``use_cache``: the setting is passed to each training forward by a
    forward pre-hook on the root, not written into the config.
    """
    hf_model = pretrained_inside(model)
    if hf_model is None:
        return []
    model = hf_model
    notes: list[str] = []
    theirs = _hf_checkpointing(model)
    if theirs and checkpointing:
        # A PreTrainedModel method; nn.Module's __getattr__ types attributes as Tensor | Module.
        disable = getattr(model, "activation_checkpointing_disable", None) or \
            cast("Callable[[], None]", model.gradient_checkpointing_disable)
        disable()
        notes.append("turned off transformers' gradient checkpointing: annot checkpoints the "
                     "Plan's units instead (stacking both would recompute every layer twice)")
    elif theirs:
        notes.append("kept transformers' gradient checkpointing: annot checkpoints nothing here")
    position = _use_cache_position(model)
    if (checkpointing or theirs) and position is not None:
        state = module_state(model)
        if state.no_cache_hook is None:
            state.no_cache_hook = model.register_forward_pre_hook(
                _no_cache_in_training(position), with_kwargs=True)
            notes.append("training forwards run with use_cache=False (a key/value cache is not "
                         "used in training and does not mix with checkpointing); the config "
                         "keeps use_cache as it was, for saving and generation")
    for note in notes:
        logger.warning("%s: %s", type(model).__name__, note)
    return notes


def _use_cache_position(model: nn.Module) -> int | None:
    """Where ``forward`` takes ``use_cache`` positionally (a large number when only by
    keyword, through ``**kwargs``), or ``None`` if it cannot take it at all."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, parameter in enumerate(parameters):
        if parameter.name == "use_cache":
            return i
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return len(parameters) + 1_000_000
    return None


@contextlib.contextmanager
def cache_off_in_training(model: nn.Module) -> Iterator[None]:
    """While open, training forwards of the transformers model inside ``model``
    (`pretrained_inside`: bare, inside PEFT or inside a module of the user's) run with
    ``use_cache=False``, as after `prepare_for_training`, unless the caller passes
    ``use_cache`` positionally. For callers that run a forward of their own on a model
    `auto_wrap` has not prepared (the memory trace): a cache written during the forward
    and again during recomputation doubles its length (pitfall 14). The switch sits on
    the transformers model itself, so it holds where a wrapper takes ``**kwargs`` (PEFT's
    ``PeftModel``: traced with the kwarg left to the wrapper, the cache stayed on and a
    checkpointed QLoRA step was priced 8 to 15% above its count)."""
    hf_model = pretrained_inside(model)
    position = _use_cache_position(hf_model) if hf_model is not None else None
    if hf_model is None or position is None:
        yield
        return
    # First of its hooks: the others see the kwargs the forward gets.
    handle = hf_model.register_forward_pre_hook(_no_cache_in_training(position), with_kwargs=True,
                                                prepend=True)
    try:
        yield
    finally:
        handle.remove()


def training_forward_kwargs(model: nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> dict[str, Any]:
    """Deprecated: use `cache_off_in_training`, which also reaches a transformers model
    inside a wrapper that takes ``**kwargs``. ``kwargs`` with ``use_cache=False`` when
    ``model`` is or holds a transformers model whose ``forward`` takes ``use_cache`` and
    the caller set it in neither ``args`` nor ``kwargs``."""
    warn_deprecated("annot.huggingface.model.training_forward_kwargs",
                    "annot.huggingface.model.cache_off_in_training", removed_in="0.4.0")
    hf_model = pretrained_inside(model)
    if hf_model is None or "use_cache" in kwargs:
        return kwargs
    position = _use_cache_position(model)
    if position is None or len(args) > position:
        return kwargs
    if hf_model is not model and position >= 1_000_000:
        return kwargs  # a module of the user's taking **kwargs: it may not pass them on
    return {**kwargs, "use_cache": False}


HookResult = tuple[tuple[Any, ...], dict[str, Any]] | None


def _no_cache_in_training(position: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], HookResult]:
    """Forward pre-hook: ``use_cache=False`` for a forward that builds a graph (training,
    grad on), unless the caller passed ``use_cache`` positionally (at ``position`` or
    later in ``args``: then it is theirs). ``position`` is read from ``forward``'s
    signature once, when the hook is installed, not on every forward."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HookResult:
        if not (module.training and torch.is_grad_enabled()) or kwargs.get("use_cache") is False:
            return None
        if len(args) > position:
            return None
        if kwargs.get("use_cache"):
            logger.warning("%s: use_cache=True in a training forward is ignored: recomputation "
                           "under checkpointing would append to the cache twice",
                           type(module).__name__)
        return args, {**kwargs, "use_cache": False}

    return hook


def _hf_checkpointing(model: nn.Module) -> bool:
    flag = getattr(type(model), "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(type(model), "is_gradient_checkpointing", None)
    return bool(flag.__get__(model)) if isinstance(flag, property) else False


#: Layer classes of transformers models that compute with their parameters outside
#: their own forward, where an engine that gathers parameters in forward hooks (FSDP2,
#: FSDP1, ZeRO-3) finds them sharded, with why.
COMPUTES_OUTSIDE_FORWARD = {
    "ReformerLayer": "its reversible residual layers recompute themselves during backward "
                     "through their backward_pass method, which no forward hook sees, so their "
                     "parameters are still sharded there (\"got mixed torch.Tensor and DTensor\")",
}


def computes_outside_forward(model: nn.Module) -> tuple[str, str] | None:
    """``(class name, why)`` of the first layer of ``model`` that computes with its
    parameters outside its forward (`COMPUTES_OUTSIDE_FORWARD`), or ``None``."""
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in COMPUTES_OUTSIDE_FORWARD:
                return cls.__name__, COMPUTES_OUTSIDE_FORWARD[cls.__name__]
    return None


def keep_output_capturing(model: nn.Module) -> int:
    """Let transformers find the outputs it records for modules an engine gave a class of
    its own: FSDP2's ``fully_shard`` swaps a module's class for a subclass named
    ``FSDP<Name>``, and transformers 5 looks up which outputs a model records
    (``_can_record_outputs``: the hidden states a vision tower's caller selects) by the
    class's string, so a sharded SigLIP tower returned no hidden states and
    LLaVA-OneVision's ``get_image_features`` failed on ``None`` (docs/design.md, pitfall
    59). Each swapped class is registered under the entry of the class it wraps. Returns
    how many were registered; a transformers without that registry is left alone."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return 0
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(registry, dict):
        return 0
    added = 0
    for module in model.modules():
        cls = type(module)
        bare = cls.__bases__[-1] if len(cls.__bases__) > 1 else None
        if bare is None or cls.__name__ != f"FSDP{bare.__name__}" or str(cls) in registry:
            continue
        entry = dict.get(registry, str(bare))
        if entry is not None:
            dict.__setitem__(registry, str(cls), entry)
            added += 1
    return added


def is_diffusers_model(model: nn.Module) -> bool:
    """A diffusers ``ModelMixin`` (a denoiser, a VAE, ...), recognised by attribute (no
    import): its class names a config file and it registers its constructor's arguments
    as its config."""
    return (getattr(type(model), "config_name", None) == "config.json"
            and hasattr(model, "register_to_config") and hasattr(model, "save_config"))
