"""`annot.from_pretrained`: a local transformers model directory, sharded and loaded in
one call.

`from_pretrained` reads a local model directory (``config.json`` plus safetensors, one file
or shards with an index), builds the model with nothing allocated (on the meta device
when the checkpoint completes it, else under `annot.meta_init`), and hands it to
`annot.auto_wrap` with ``load_from=`` the directory: FSDP2 shards the model on the meta
device first, then each rank reads only its own rows of every tensor;
the initialization of what the checkpoint provides is never run, and non-persistent
buffers (rotary frequencies, masks, scales) are recomputed from the construction record.

transformers is imported inside the functions, so ``import annot`` stays light.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from annot.checkpoint_io.formats import CheckpointSource
from annot.errors import CheckpointError
from annot.huggingface.model import is_peft_model, keep_in_fp32_names, model_factory

__all__ = ["PretrainedPathError", "build_pretrained", "from_pretrained", "model_folder",
           "train_loaded_parameters"]


class PretrainedPathError(CheckpointError):
    """The path given to `annot.from_pretrained` is not a local HuggingFace model directory."""


def from_pretrained(
    path: str | os.PathLike[str],
    engine: str | None = "fsdp2",
    *,
    torch_dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    auto_class: type | str | None = None,
    strict: bool = False,
    peft_config: Any = None,
    mmap: bool = False,
    component: str | None = None,
    freeze: Sequence[str] | str | None = None,
    quantize: str | None = None,
    unquantized: Any = None,
    **auto_wrap_options: Any,
) -> Any:
    """Load the transformers or diffusers model saved in the local directory ``path``,
    wrapped for ``engine``.

    ``path`` is a model folder (``save_pretrained``'s output, or a downloaded snapshot),
    or a diffusers pipeline folder (``model_index.json``): then ``component`` names the
    folder to load (``"transformer"``, ``"vae"``, ``"text_encoder"``, ...; by default the
    denoiser: ``transformer``, else ``unet``). A diffusers model folder (its
    ``config.json`` names a ``_class_name``) builds that diffusers class in
    ``torch_dtype`` (default float32) with the tensors its ``_keep_in_fp32_modules`` names
    kept in float32, as diffusers' ``from_pretrained`` does, and reads
    ``diffusion_pytorch_model*.safetensors`` (`annot.huggingface.diffusers_model`).

    ``freeze`` names parts of the model to keep as loaded (`annot.freeze`: ``"vision"``,
    ``"projector"``, ``"language"``, ``"encoder"``, ...; one name or several): frozen
    before the Plan is made, so they get no optimizer state or gradient buffers and a
    frozen tower's blocks are not checkpointed. A frozen diffusion text encoder or VAE:
    ``freeze="all"`` (forward only).

    For transformers: read ``config.json`` (offline: the hub is never contacted); pick the class
    (``auto_class`` if given, a class or a name like ``"AutoModelForCausalLM"``; else the
    config's ``architectures``; else the first of `AUTO_CLASS_ORDER` that knows the
    config); build it with nothing allocated (`build_pretrained`) in ``torch_dtype``
    (``None``/``"auto"``: the config's ``dtype``, else float32), keeping
    ``_keep_in_fp32_modules`` in float32 as transformers does (for float16;
    ``_keep_in_fp32_modules_strict`` also for bfloat16);
    then ``annot.auto_wrap(model, engine, load_from=path, **auto_wrap_options)``.

    Memory: with ``engine="fsdp2"`` each rank allocates and reads only its shards, no rank
    ever holds the whole model; with ``"fsdp1"`` and DeepSpeed ZeRO-3 a rank also holds
    one unit's full tensors while the engine shards it, then reads the rows its shards
    cover. ``"ddp"`` and ZeRO-1/2 keep whole parameters, so every rank loads all of it.
    The initialization of loaded weights is skipped in every case.

    Keys: as with transformers, weights the files lack (a new head) keep their
    initialization and keys the model lacks (a head it does not have) are ignored, both
    logged as a warning; ``strict=True`` refuses either with `annot.CheckpointError`
    listing them, before anything is allocated.

    ``peft_config`` (a PEFT config, e.g. ``peft.LoraConfig(...)``) adds the adapters in
    the same meta-device build (``peft.get_peft_model``), so the base weights are read
    shard by shard into the PEFT model and the adapters get PEFT's own initialization,
    bitwise as eager construction with the same seed; the result is the ``PeftModel``
    (wrapped for ``engine``).

    ``mmap=True`` maps the weights from the files instead of reading them (the CPU with
    FSDP2, DDP or no engine; a page is copied when first written): the fastest load from
    a warm page cache, as transformers' own loading maps them. The files must then stay
    as they are while the model lives (`annot.load`).

    ``quantize="nf4"`` (QLoRA; needs torchao, the ``qlora`` extra) quantizes the frozen
    linears' weights to 4-bit NormalFloat while loading, each read whole and quantized
    once, then split over the ranks by FSDP2 (`annot.quantization`: which linears, and
    why some stay in ``torch_dtype``, is logged). The base must be frozen by
    ``peft_config`` or ``freeze``; ``engine`` must be ``"fsdp2"`` or ``None`` (the others
    are refused by name), without ``mesh=`` (the ranks FSDP2 splits over are then every
    rank). ``unquantized``: a rule (`annot.by_name`, `annot.by_class`, ... or its text,
    ``"o_proj"``) whose modules keep their frozen linears in ``torch_dtype``.

    ``engine=None`` returns the bare model, loaded and in eval mode like transformers'
    ``from_pretrained`` (no process group needed). With an engine the model is in training
    mode, as `auto_wrap` returns it. Raises `PretrainedPathError` when ``path`` is not a
    local directory with a ``config.json``. Training mode means every module: a part its
    constructor put in eval mode (Emu3's VQ tokenizer) is set to training mode too, as
    transformers' ``from_pretrained`` followed by the ``model.train()`` every trainer
    calls leaves it, so a step equals that one.
    """
    from annot.formats.choice import checkpoint_source
    from annot.wrap import auto_wrap

    path = model_folder(path, component)
    if engine is None and auto_wrap_options:  # before the build: a mistake costs no load
        raise ValueError(f"engine=None takes no auto_wrap options, got {', '.join(auto_wrap_options)}")
    if unquantized is not None and quantize is None:
        raise ValueError("unquantized= says which linears a quantized base keeps in its dtype: "
                         "pass quantize='nf4' too")
    if quantize is not None:
        _refuse_quantize(quantize, engine, mmap, auto_wrap_options)
    model = build_pretrained(path, torch_dtype=torch_dtype, trust_remote_code=trust_remote_code,
                             auto_class=auto_class, peft_config=peft_config)
    if strict:
        _refuse_mismatch(model, path)
    if freeze is not None:
        _freeze(model, freeze)
    source = checkpoint_source(model, path)
    if quantize is not None:
        source = _quantize(model, source, engine, auto_wrap_options.get("device"), unquantized)
    if engine is None:
        from annot.checkpoint_io.loading import load_source

        load_source(model, source, None, mmap=mmap)
        return _guarded(model.eval(), quantize)
    return _guarded(auto_wrap(model.train(), engine, load_from=source, mmap=mmap, **auto_wrap_options),
                    quantize)


def _guarded(loaded: Any, quantize: str | None) -> Any:
    """``loaded`` (the model, or the `Trainable` holding it), the model's dtype casts
    refused when its base is quantized (`annot.quantization.refuse_dtype_casts`)."""
    if quantize is not None:
        from annot.engines.base import Trainable
        from annot.quantization import refuse_dtype_casts

        refuse_dtype_casts(loaded.model if isinstance(loaded, Trainable) else loaded)
    return loaded


def _refuse_quantize(quantize: str, engine: str | None, mmap: bool, options: dict[str, Any]) -> None:
    from annot.quantization import nf4_tensor_type, refuse_format

    refuse_format(quantize, engine)
    if options.get("float8") not in (None, False):
        raise ValueError(f"quantize={quantize!r} with float8=: a quantized weight is dequantized by "
                         "its own linear, which float8 would replace; train the adapters of a "
                         "quantized base in the model's dtype (leave float8 out)")
    if "mesh" in options:
        raise ValueError(f"quantize={quantize!r} with mesh=: not built yet (a quantized weight must "
                         "split into whole scale blocks on the ranks it is sharded over, checked "
                         "for every rank): leave mesh out")
    if mmap:
        raise ValueError(f"quantize={quantize!r} with mmap=True: a quantized weight is new memory, "
                         "not the file's")
    nf4_tensor_type()  # torchao is there, before the build


def _quantize(model: nn.Module, source: CheckpointSource, engine: str | None,
              device: torch.device | str | None, unquantized: Any) -> CheckpointSource:
    """Quantize ``model``'s frozen linears from ``source`` (`annot.quantization`) for
    ``engine``'s ranks, on the device the engine computes on (a GPU quantizes a weight
    in milliseconds, a CPU rank in about a second per 4M weights); refuses a model with
    nothing frozen to quantize."""
    import torch.distributed as dist

    from annot.devices import choose_device
    from annot.quantization import choose_linears, quantize_on_load

    # FSDP2 splits each weight over the ranks (whole NF4 blocks each); DDP keeps it whole.
    shards = dist.get_world_size() if engine in ("fsdp2", "fully_shard") and dist.is_initialized() else 1
    linears = choose_linears(model, shards, unquantized)
    if not linears.quantized:
        raise ValueError(
            "quantize='nf4' quantizes frozen linears, and this model has none that can be: "
            + ("freeze the base with peft_config=... (LoRA) or freeze=..." if not linears.kept
               else linears.describe()))
    return quantize_on_load(model, source, linears,
                            choose_device(device) if engine is not None else torch.device("cpu"))


def _freeze(model: nn.Module, parts: Sequence[str] | str) -> None:
    """`annot.freeze` of ``parts`` (``"all"``: every parameter)."""
    from annot.freezing import freeze

    names = [parts] if isinstance(parts, str) else list(parts)
    if names == ["all"]:
        model.requires_grad_(False)
        return
    freeze(model, *names)


def _refuse_mismatch(model: nn.Module, path: Path) -> None:
    missing, unexpected = _check_keys(model, path)
    if is_peft_model(model):  # the adapters are new: no base checkpoint holds them
        missing = [name for name in missing if ".lora_" not in name]
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match {type(model).__name__}: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]} (strict=True; strict=False initializes what is "
            "missing and ignores the rest, as transformers does)")


def model_folder(path: str | os.PathLike[str], component: str | None = None) -> Path:
    """The model folder ``path`` names: itself, or ``component`` of the diffusers pipeline
    folder ``path`` (by default its denoiser). Raises `PretrainedPathError` when it is no
    local folder with a ``config.json``."""
    from annot.formats.diffusers import PIPELINE_INDEX, component_folder

    directory = Path(path)
    if not directory.is_dir():
        raise PretrainedPathError(
            f"{path}: not a local directory. annot.from_pretrained reads a model saved with "
            "save_pretrained (or downloaded with `huggingface-cli download`); it never "
            "contacts the hub")
    if (directory / PIPELINE_INDEX).is_file() or component is not None:
        try:
            directory = component_folder(directory, component)
        except CheckpointError as exc:
            raise PretrainedPathError(str(exc)) from None
    if not (directory / "config.json").is_file():
        raise PretrainedPathError(
            f"{directory}: no config.json, so this is not a HuggingFace model directory "
            "(save one with model.save_pretrained(directory))")
    return directory


def build_pretrained(
    path: str | os.PathLike[str],
    *,
    torch_dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    auto_class: type | str | None = None,
    peft_config: Any = None,
) -> nn.Module:
    """The model of ``path``'s config, built with nothing allocated and no weights read:
    what `from_pretrained` loads into. Options as there.

    First on the meta device (`annot.meta.deferred.meta_device_init`, 2-3x faster than
    fake tensors: the build was a third of a warm 1.1B load), kept only if the checkpoint supplies
    every persistent tensor and the record computes every other one (the non-persistent
    buffers); otherwise, and with adapters (new tensors, initialized as PEFT does), built
    again under `annot.meta_init` (docs/design.md, pitfall 29)."""
    from annot.meta.deferred import meta_device_init, meta_init

    path = model_folder(path)
    construct = _constructor(path, torch_dtype, trust_remote_code, auto_class)

    def build(recording: Callable[[], contextlib.AbstractContextManager[None]]) -> nn.Module:
        with recording():
            model = construct()
            if peft_config is not None:  # in the same block: one record for base and adapters
                import peft

                model = peft.get_peft_model(model, peft_config)
        return model

    if peft_config is None:
        # A constructor that seeds draws the same again in the second build.
        rng = torch.get_rng_state(), random.getstate()
        try:
            model = build(meta_device_init)
        except Exception:  # noqa: BLE001 - e.g. `.item()` of a meta tensor: fake tensors can
            pass  # (and a real error in the config is raised again by that build)
        else:
            if _checkpoint_completes(model, path):
                train_loaded_parameters(model, path)
                return model
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
    model = build(meta_init)
    if peft_config is None:  # PEFT freezes the base model: its choice stands
        train_loaded_parameters(model, path)
    return model


def _refuse_quantized_checkpoint(folder: Path, hf_config: Any) -> None:
    """Refuse a folder whose weights are stored quantized (its config's
    ``quantization_config``: bitsandbytes, GPTQ, AWQ, FP8, ...): annot builds the model
    in full precision and reads full-precision tensors, so such a folder failed later on
    the first packed weight's shape, or loaded a format's bytes as weights where shapes
    happened to agree."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    settings = quantization if isinstance(quantization, dict) else getattr(quantization, "to_dict", dict)()
    method = settings.get("quant_method", "unknown")
    raise CheckpointError(
        f"{folder} holds weights already quantized ({method}: config.json's quantization_config), "
        "and annot reads full-precision checkpoints: load the original (bf16 or fp32) "
        "checkpoint, with quantize='nf4' for a 4-bit frozen base (annot quantizes while "
        "loading, each weight once)")


def _constructor(folder: Path, torch_dtype: torch.dtype | str | None, trust_remote_code: bool,
                 auto_class: type | str | None) -> Callable[[], nn.Module]:
    """A function building the model of ``folder``'s config (to call inside a recording
    block, so the dtype casts are on the record and replayed): a diffusers model when
    the config names a diffusers class, else transformers' class for it."""
    from annot.formats.diffusers import is_diffusers_folder

    if is_diffusers_folder(folder):
        from annot.huggingface import diffusers_model

        if auto_class is not None or trust_remote_code:
            raise ValueError(f"{folder} holds a diffusers model: auto_class= and trust_remote_code= "
                             "choose among transformers' classes")
        config = diffusers_model.read_config(folder)
        dtype = _resolve_dtype(torch_dtype, None)
        return lambda: diffusers_model.build(config, dtype)
    # Read at import by huggingface_hub, so set before transformers is first imported;
    # local_files_only below covers a process that imported it already.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                           local_files_only=True)
    _refuse_quantized_checkpoint(folder, hf_config)
    hf_dtype = _resolve_dtype(torch_dtype, hf_config)
    factory = model_factory(hf_config, auto_class, trust_remote_code)

    def construct() -> nn.Module:
        model = factory(hf_config, dtype=hf_dtype)
        for module_path in keep_in_fp32_names(model, hf_dtype):
            model.get_submodule(module_path).float()
        return model

    return construct


def train_loaded_parameters(model: nn.Module, path: str | os.PathLike[str]) -> list[str]:
    """Make trainable every floating-point parameter of the transformers model ``model``,
    as transformers' ``from_pretrained`` does: it wraps each tensor it loads in a new
    ``Parameter`` with ``requires_grad=is_floating_point()``, and each parameter the
    checkpoint lacks (not tied to one it has) in a new one the same way before
    initialising it, whatever the constructor chose. So Marian's, Pegasus' and RoFormer's
    sinusoidal position tables, frozen when built, train after a load, those the checkpoint
    holds and those it leaves out (MarianMT's, ignored on save: issue #42 found annot's
    step 1.2e-4 off from the second step). annot matches that, because plain
    ``from_pretrained`` is what users compare with, and says so: the changed names go
    into the Plan's warnings (`annot.module_state.ModuleState.plan_notes`). What
    transformers' post-load initialisation freezes again stays frozen
    (`_frozen_by_init_weights`). A model that is not a transformers model (a diffusers
    model: diffusers keeps each parameter's ``requires_grad``) is left as it is. Returns
    the names made trainable. ``path`` is the checkpoint the model will be loaded from."""
    from annot.huggingface.model import is_pretrained_model
    from annot.module_state import module_state

    if not is_pretrained_model(model):
        return []
    frozen = [name for name, p in model.named_parameters()
              if not p.requires_grad and p.is_floating_point()]
    if not frozen:
        return []
    for name in frozen:
        model.get_parameter(name).requires_grad_(True)
    refrozen = _frozen_by_init_weights(model)
    changed = [name for name in frozen if name not in refrozen]
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        module_state(model).plan_notes += (
            f"trainable as transformers' from_pretrained loads them, though "
            f"{type(model).__name__}'s constructor freezes them: {shown} (leave them out of "
            "the optimizer to keep them fixed, as in eager construction)",)
    return changed


def _frozen_by_init_weights(model: nn.Module) -> set[str]:
    """Run transformers' post-load weight initialisation (``initialize_weights``, which
    ``from_pretrained`` runs after reading the files) on ``model`` for its side effects
    alone, and return the parameters it froze (they stay frozen). transformers' own
    initialisers skip a tensor marked ``_is_hf_initialized``, as a loaded one is, so every
    tensor is marked for the pass: no value changes (the model is on the meta device
    anyway), but an ``_init_weights`` that calls ``requires_grad_(False)`` does so, as in
    a plain load: HRM's ``z_L_init`` is loaded, made trainable by the loader, and frozen
    again there (issue #29's sweep found annot training it). A pass that raises on the
    meta device leaves the parameters as they were, with a Plan warning."""
    from annot.module_state import module_state

    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:
        return set()
    marked = [t for t in [*model.parameters(), *model.buffers(), *model.modules()]
              if not hasattr(t, "_is_hf_initialized")]
    tensors = [t for t in marked if isinstance(t, torch.Tensor)]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for tensor in tensors:
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        initialize()
    except Exception as exc:  # noqa: BLE001 - a model's own code on the meta device
        module_state(model).plan_notes += (
            f"could not run {type(model).__name__}'s weight initialisation on the meta device "
            f"({type(exc).__name__}) to see which parameters it freezes after a load: every "
            "loaded floating-point parameter trains",)
        return set()
    finally:
        for item in marked:
            if hasattr(item, "_is_hf_initialized"):
                delattr(item, "_is_hf_initialized")
    return {name for name, p in model.named_parameters() if name in trainable and not p.requires_grad}


def _checkpoint_completes(model: nn.Module, path: Path) -> bool:
    """Whether a meta-device build of ``model`` is whole once ``path`` is loaded: every
    persistent tensor in the checkpoint (what the files lack would keep the constructor's
    init, not transformers' ``_init_weights``, which the meta device skips) and every
    other one computed by the record."""
    from annot.meta.deferred import deferred_init_of

    record = deferred_init_of(model)
    missing, _ = _check_keys(model, path)
    return (record is not None and not missing
            and set(record.uninitialized()) <= set(model.state_dict()))


def _check_keys(model: nn.Module, path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys of the checkpoint at ``path`` read into ``model`` in
    its library's format, from the files' headers."""
    from annot.checkpoint_io.loading import check_keys
    from annot.formats.choice import checkpoint_source

    source = checkpoint_source(model, path)
    return check_keys(model, source.path, format=source.format)


def _resolve_dtype(torch_dtype: torch.dtype | str | None, config: Any) -> torch.dtype:
    if torch_dtype is None or torch_dtype == "auto":
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(torch_dtype, str):
        resolved = getattr(torch, torch_dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"torch_dtype={torch_dtype!r} is not a torch dtype")
        return resolved
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"torch_dtype must be a torch.dtype, a name or 'auto', not {torch_dtype!r}")
    return torch_dtype


