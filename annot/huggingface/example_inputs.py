"""One training batch for a transformers model of the heads beyond causal LMs:
image-text-to-text and other multimodal LMs, seq2seq and speech seq2seq, masked LM,
image classification.

`training_inputs` returns the keyword arguments of one training forward that returns a
loss: the labels, ``use_cache=False`` where ``forward`` takes it, and for a model that
reads images or audio the media inputs of the shapes its towers take, with exactly as
many placeholder tokens in ``input_ids`` as those towers produce features.

How the placeholder count is found: by running the model's own ``get_image_features``
(``get_audio_features``) once under ``torch.no_grad()`` on one item and counting the
feature vectors it returns. Families whose tower reads values of its inputs (a patch
grid as Python numbers, a mask of padded images) get the count from their config or
the grid this module chose instead, always (the Qwen2-VL grid, Idefics) or where the
parameters hold no values (`_COUNT_WITHOUT_VALUES`, `_AUDIO_COUNT_WITHOUT_VALUES`). So
the function also serves a model whose parameters are fake tensors (the memory
planner's trace): called inside the ``FakeTensorMode`` they belong to, every tensor it
makes is fake too, a tower it runs runs fake, and the only values it reads are
integers it chose itself.

A family that needs more than the generic recipe has its own entry (`_IMAGE_FAMILIES`,
`_FAMILIES`), each with the reason. A model this module cannot serve is refused with
`ExampleInputsError` (a ``ValueError``) naming its class and what is unknown: it never
returns inputs it is not sure of.

transformers is imported inside the functions: ``import annot`` stays light.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from annot.policies.errors import AnnotError

__all__ = ["AUDIO_INPUTS", "IMAGE_INPUTS", "ExampleInputsError", "training_inputs"]

#: Forward arguments that carry images (a batch with any of them is an image batch).
IMAGE_INPUTS = frozenset({
    "pixel_values", "image_patches", "flattened_patches", "image_pixel_values", "pixel_values_images",
})
#: Forward arguments that carry audio.
AUDIO_INPUTS = frozenset({"input_features", "input_values", "audio_input_features"})
#: A label the loss does not count (transformers' ignore index).
IGNORE = -100
# modality of a token, as transformers' ``mm_token_type_ids`` numbers them
_TEXT, _IMAGE, _AUDIO = 0, 1, 3


class ExampleInputsError(AnnotError, ValueError):
    """`training_inputs` cannot build a batch for this model: the message names the
    model's class and what is unknown."""


def training_inputs(
    model: nn.Module,
    *,
    batch: int,
    seq: int,
    generator: torch.Generator | None = None,
    image_size: int | None = None,
    images_per_sample: int = 1,
    audio_frames: int | None = None,
    with_images: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of one training forward of ``model`` (a transformers
    ``PreTrainedModel``) that returns a loss, for ``batch`` samples.

    ``seq`` is the length of each sample's ``input_ids`` (the encoder's, for an
    encoder-decoder, whose labels are as long), placeholder tokens of images and audio
    included: a sample whose media need more placeholders than ``seq`` leaves room for
    one text token is refused. ``image_size`` (pixels, square) defaults to the vision
    config's; ``images_per_sample`` images go before each sample's text;
    ``audio_frames`` defaults to what the audio encoder requires, else a small length.
    ``with_images=False`` gives a text-only batch for the same model (no media inputs,
    no placeholders), as a rank whose batch holds no image would run; a model that
    cannot run without images is refused.

    Random values come from ``generator`` (a CPU generator; a fixed seed without one),
    so equal generators give equal batches. Called inside a ``FakeTensorMode``, every
    tensor returned is fake, and a tower run to count features runs fake too. Raises
    `ExampleInputsError` (a ``ValueError``) naming the model's class and what is
    unknown where the model cannot be served."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be at least 1, got batch={batch}, seq={seq}")
    if images_per_sample < 1:
        raise ValueError(f"images_per_sample must be at least 1, got {images_per_sample}")
    maker = _Maker(model, generator if generator is not None else torch.Generator().manual_seed(0))
    if "labels" not in maker.params:
        raise maker.unknown("a loss: its forward takes no labels")
    request = _Request(batch=batch, seq=seq, image_size=image_size, images=images_per_sample,
                       audio_frames=audio_frames, media=with_images)
    family = _FAMILIES.get(maker.model_type)
    inputs = family(maker, request) if family is not None else _by_signature(maker, request)
    media = [name for name in _MEDIA_INPUTS if inputs.get(name) is not None]
    if not with_images and media:
        # A model that takes nothing but its media (an image classifier) has no
        # text-only batch: never hand back media where none was asked for.
        raise maker.unknown(f"a batch without media: its inputs are media ({', '.join(media)})")
    if "use_cache" in maker.params:
        # A training step keeps no key/value cache (docs/design.md, pitfall 14).
        inputs["use_cache"] = False
    if "sample" in maker.params and any(key in AUDIO_INPUTS for key in inputs):
        # VibeVoice's audio tokenizer adds Gaussian noise to its latents unless told not to.
        inputs["sample"] = False
    return inputs


#: The inputs that carry images, video or audio.
_MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "input_features", "input_values")


@dataclasses.dataclass(frozen=True)
class _Request:
    """What the caller asked for (`training_inputs`' arguments)."""

    batch: int
    seq: int
    image_size: int | None
    images: int
    audio_frames: int | None
    media: bool


@dataclasses.dataclass
class _Media:
    """One kind of media of a batch: the forward arguments that carry it (every item of
    every sample), and the tokens one item takes in ``input_ids``: ``block``, its
    wrappers included, with each token's modality in ``kinds`` (`_TEXT`, `_IMAGE`,
    `_AUDIO`: the non-text ones are where the features go). ``finish`` adds what
    depends on the whole sequence (a mask of what each token attends to), given the
    output so far and every sample's token modalities."""

    inputs: dict[str, torch.Tensor]
    block: list[int]
    kinds: list[int]
    finish: Callable[[dict[str, Any], list[list[int]]], None] | None = None


class _Maker:
    """What building a batch for one model needs: its config, its forward's
    parameters, the random numbers, and where the tensors go."""

    def __init__(self, model: nn.Module, generator: torch.Generator) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise ExampleInputsError(f"{type(model).__name__} has no transformers config: "
                                     "training_inputs serves transformers models")
        self.model = model
        self.config = config
        self.name = type(model).__name__
        self.model_type = str(getattr(config, "model_type", ""))
        self.params = set(inspect.signature(model.forward).parameters)
        self.generator = generator
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        if self.device.type == "meta" and detect_fake_mode() is not None:
            # A meta model traced under a fake mode (annot's memory trace): the inputs
            # are fake CPU tensors, as the trace's parameters are.
            self.device = torch.device("cpu")
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        # Fake (a trace) or meta parameters: a tower run here computes shapes, not values.
        self.has_values = first is None or not (isinstance(first, FakeTensor) or first.device.type == "meta")

    # tensors ------------------------------------------------------------------------

    def ints(self, values: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A tensor of integers this module chose (under a fake mode: a fake one)."""
        return torch.tensor(values, dtype=dtype, device=self.device)

    def draw(self, low: int, high: int, shape: tuple[int, ...]) -> list[Any]:
        """Random integers in ``[low, high)`` as Python values, drawn for real even under
        a fake mode: they become token ids, which a model may read."""
        with _disable_current_modes():
            return torch.randint(low, high, shape, generator=self.generator).tolist()

    def floats(self, *shape: int) -> torch.Tensor:
        """Standard-normal values (pixels, audio features) in the model's float dtype; a
        constant where the model has no values (fake or meta parameters: a trace), so a
        tower that checks its input's values (Idefics3 drops all-zero images) finds them
        known to annot's memory trace (`annot.memory.routing_values`)."""
        if not self.has_values:
            return torch.full(shape, 0.5, dtype=self.dtype, device=self.device)
        values = torch.randn(shape, generator=self.generator, dtype=torch.float32)
        return values.to(device=self.device, dtype=self.dtype)

    def ones(self, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=self.device)

    # the config ---------------------------------------------------------------------

    def sub(self, *names: str) -> Any:
        """The first of the sub-configs ``names`` the config has, else None."""
        for name in names:
            value = getattr(self.config, name, None)
            if value is not None and hasattr(value, "to_dict"):
                return value
        return None

    def get(self, *names: str, config: Any = None) -> Any:
        """The first of the attributes ``names`` that is set (not None) on ``config``,
        or by default on the model's config, then its text config."""
        configs = [config] if config is not None else [self.config, self.sub("text_config")]
        for cfg in configs:
            for name in names:
                value = getattr(cfg, name, None) if cfg is not None else None
                if value is not None:
                    return value
        return None

    def need(self, what: str, *names: str, config: Any = None) -> Any:
        value = self.get(*names, config=config)
        if value is None:
            raise self.unknown(f"{what} (none of {', '.join(names)} is set in its config)")
        return value

    def unknown(self, what: str) -> ExampleInputsError:
        return ExampleInputsError(f"training_inputs cannot build a batch for {self.name} "
                                  f"(model_type {self.model_type!r}): unknown {what}")

    def vocab(self, config: Any = None) -> int:
        """The vocabulary of ``config`` (default: the text model's)."""
        for cfg in ([config] if config is not None else [self.sub("text_config", "text_decoder", "encoder"),
                                                          self.config]):
            value = getattr(cfg, "vocab_size", None) if cfg is not None else None
            if isinstance(value, int):
                return value
        raise self.unknown("the text vocabulary (no vocab_size in its config)")

    def special_ids(self) -> set[int]:
        """Every token id the config tree names (bos, pad, image...): text avoids them."""
        found: set[int] = set()
        for config in _config_tree(self.config):
            for key, value in vars(config).items():
                if key.endswith(("token_id", "token_index", "token_ids", "_token_idx", "_patch_id")):
                    for v in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(v, int) and not isinstance(v, bool):
                            found.add(v)
                elif key == "vocabulary_map" and isinstance(value, dict):
                    # Chameleon, Emu3: image codes' vocabulary tokens, whose logits the model masks
                    found.update(v for v in value.values() if isinstance(v, int))
        return found

    def text(self, rows: int, length: int, vocab: int | None = None) -> list[list[int]]:
        """``rows`` x ``length`` ordinary token ids: none the config names as special."""
        vocab = vocab if vocab is not None else self.vocab()
        special = self.special_ids()
        ordinary = [i for i in range(min(vocab, 1 << 16)) if i not in special]
        if not ordinary:
            raise self.unknown(f"an ordinary token (every id below {vocab} is special)")
        drawn = self.draw(0, len(ordinary), (rows, length))
        return [[ordinary[i] for i in row] for row in drawn]

    def method(self, name: str) -> Callable[..., Any] | None:
        """``model.<name>``, or the inner model's (a head wrapping ``model.model``);
        the inner one where the head's only passes ``*args, **kwargs`` on."""
        found = [getattr(owner, name) for owner in (self.model, getattr(self.model, "model", None))
                 if callable(getattr(owner, name, None))]
        for function in found:
            kinds = {p.kind for p in inspect.signature(function).parameters.values()}
            if kinds - {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
                return function
        return found[0] if found else None

    def attribute(self, name: str) -> Any:
        """An attribute of the model or one of its submodules (the first found)."""
        for module in self.model.modules():
            value = getattr(module, name, None)
            if value is not None and not callable(value):
                return value
        return None


def _halved(length: int) -> int:
    """The output length of a padded stride-2 convolution (Whisper's second one)."""
    return (length - 1) // 2 + 1


def _config_tree(config: Any) -> Iterator[Any]:
    """``config`` and every config nested in it, depth first."""
    yield config
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _config_tree(value)


def _find(config: Any, *names: str) -> Any:
    """The first of ``names`` set anywhere in ``config``'s tree."""
    for cfg in _config_tree(config):
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return None


# -- text ---------------------------------------------------------------------------


def _masked_targets(ids: list[list[int]]) -> list[list[int]]:
    """Masked-LM targets: every third position counts, the rest is ignored (a masked
    LM's loss covers the masked positions only)."""
    return [[t if j % 3 == 0 else IGNORE for j, t in enumerate(row)] for row in ids]


def _is_masked_lm(maker: _Maker) -> bool:
    from transformers.models.auto import modeling_auto

    names = {n for v in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()
             for n in (v if isinstance(v, tuple) else (v,))}
    return maker.name in names and not getattr(maker.config, "is_encoder_decoder", False)


def _text_batch(maker: _Maker, request: _Request) -> dict[str, Any]:
    """A decoder's or an encoder's text batch: ids, mask, and labels (masked-LM targets
    for a masked LM, the ids themselves for a model that shifts them)."""
    ids = maker.text(request.batch, request.seq)
    labels = _masked_targets(ids) if _is_masked_lm(maker) else ids
    out = {"input_ids": maker.ints(ids), "attention_mask": maker.ones(request.batch, request.seq),
           "labels": maker.ints(labels)}
    if "lang_ids" in maker.params:
        # X-MOD routes each sample through one language's adapters and has no default
        # language: the first of its config's languages.
        out["lang_ids"] = maker.ints([0] * request.batch)
    return out


def _seq2seq_labels(maker: _Maker, request: _Request, out: dict[str, Any],
                    decoder: Any = None) -> dict[str, Any]:
    """``out`` (the encoder's inputs) with labels of ``seq`` tokens of the decoder's
    vocabulary. The model derives the decoder's inputs from the labels (shifted right
    behind ``decoder_start_token_id``) where its config says how; else they are given,
    shifted the same way here."""
    decoder = decoder if decoder is not None else maker.sub("decoder", "text_config", "decoder_config")
    vocab = maker.vocab(decoder) if decoder is not None and isinstance(
        getattr(decoder, "vocab_size", None), int) else maker.vocab()
    labels = maker.text(request.batch, request.seq, vocab)
    out = {**out, "labels": maker.ints(labels)}
    start = _find(maker.config, "decoder_start_token_id")
    # The shift also needs the pad id (Moonshine's config has none).
    if start is None or _find(maker.config, "pad_token_id") is None or maker.model_type in _EXPLICIT_DECODER_INPUTS:
        start = start if start is not None else _find(maker.config, "bos_token_id", "pad_token_id")
        if not isinstance(start, int):
            raise maker.unknown("the decoder's start token (no decoder_start_token_id, bos or pad id)")
        if "decoder_input_ids" not in maker.params:
            raise maker.unknown("how the decoder's inputs are given (no decoder_start_token_id "
                                "and forward takes no decoder_input_ids)")
        out["decoder_input_ids"] = maker.ints([[start] + row[:-1] for row in labels])
    return out


# Composite encoder-decoders: their configs lack the ids the shift needs unless a user
# sets them, so the decoder's inputs are given.
_EXPLICIT_DECODER_INPUTS = {"encoder-decoder", "speech-encoder-decoder", "vision-encoder-decoder",
                            "pp_formulanet"}  # PP-FormulaNet's forward does not shift its labels


# -- images -------------------------------------------------------------------------


def _vision(maker: _Maker) -> Any:
    """The vision tower's config (nested in an encoder's config for T5Gemma 2)."""
    vision = maker.sub("vision_config", "vision_tower_config")
    if vision is None:
        for cfg in _config_tree(maker.config):
            if cfg is not maker.config and getattr(cfg, "vision_config", None) is not None:
                return cfg.vision_config
    return vision if vision is not None else maker.config


# Image sizes of towers whose config names none (any size works, this one is small).
_DEFAULT_IMAGE_SIZE = {
    "florence2": 64,  # DaViT: four stages of strides 4, 2, 2, 2
    "apertus1p5": 32,  # a VQ tokenizer that downsamples 16x
    "chameleon": 32,  # likewise
    "emu3": 32,  # a VQ tokenizer that downsamples 8x
}


def _image_size(maker: _Maker, request: _Request, default: int | None = None) -> int:
    if request.image_size is not None:
        return request.image_size
    default = _DEFAULT_IMAGE_SIZE.get(maker.model_type, default)
    size = _find(_vision(maker), "image_size")  # nested for SAM-based towers
    if isinstance(size, (list, tuple)):
        size = size[0]
    if isinstance(size, int):
        return size
    if default is not None:
        return default
    raise maker.unknown("the image size (its vision config has no image_size; pass image_size=)")


def _channels(maker: _Maker) -> int:
    value = maker.get("num_channels", "in_channels", "in_chans", config=_vision(maker))
    return value if isinstance(value, int) else 3


def _patch(maker: _Maker) -> int:
    patch = maker.need("patch size", "patch_size", config=_vision(maker))
    return int(patch[0] if isinstance(patch, (list, tuple)) else patch)


def _image_token(maker: _Maker) -> int:
    return int(maker.need("image token id", "image_token_id", "image_token_index"))


def _count(maker: _Maker, method: str, inputs: dict[str, Any], size: int | None = None) -> int:
    """The feature vectors ``model.<method>`` makes of ``inputs`` (one item, ``size``
    pixels a side where it is an image), run once under ``torch.no_grad()``: every
    tensor it returns counts its rows (all but the last, the width, dimension).

    A model whose parameters hold no values (fake or meta tensors) runs its tower fake,
    which fails where the tower reads a value of its inputs (an image size as a Python
    number); those families count by the arithmetic of `_COUNT_WITHOUT_VALUES`."""
    formula = _COUNT_WITHOUT_VALUES.get(maker.model_type)
    if formula is not None and not maker.has_values and size is not None:
        return formula(maker, size)
    function = maker.method(method)
    if function is None:
        raise maker.unknown(f"how many tokens an item takes (it has no {method})")
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = dict(inputs)  # it passes on what it does not name (MOSS's padding_mask)
    else:
        kwargs = {k: v for k, v in inputs.items() if k in parameters}
    accepted = set(parameters)
    for name in ("vision_feature_layer", "vision_feature_select_strategy"):
        if name in accepted and name not in kwargs and getattr(maker.config, name, None) is not None:
            kwargs[name] = getattr(maker.config, name)
    with torch.no_grad():
        out = function(**kwargs)
    features = _features_of(out)
    tensors = [features] if isinstance(features, torch.Tensor) else list(features or [])
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        raise maker.unknown(f"the feature count ({method} returned {type(out).__name__})")
    return sum(t.numel() // t.shape[-1] if t.dim() > 1 else 1 for t in tensors)


def _vq_side(maker: _Maker, size: int) -> int:
    """Codes a side of a VQ image tokenizer: one per 2**(levels - 1) pixels."""
    vq = maker.sub("vq_config", "vision_config")
    factor = getattr(vq, "spatial_scale_factor", None) or 2 ** (len(vq.channel_multiplier) - 1)
    return size // int(factor)


def _anyres_count(maker: _Maker, size: int) -> int:
    """LLaVA-NeXT's tokens for an image of exactly one tile: the base view's patches,
    then the tile's, each row of those followed by a newline token (Granite 4 Vision
    first pools windows by ``downsample_rate``)."""
    tile = _image_size(maker, _Request(1, 1, None, 1, None, True))
    if size != tile:
        raise maker.unknown(f"the tokens of a {size}-pixel image without running the tower (its fake "
                            f"parameters hold no values): pass image_size={tile}, one tile")
    side = size // _patch(maker)
    rate = maker.get("downsample_rate")
    if isinstance(rate, str):
        numerator, denominator = (int(v) for v in rate.split("/"))
        side = side * numerator // denominator
    return side * side + side * (side + 1)


# Tokens per image, from its size, of the families whose tower reads values of its
# inputs (used where the parameters are fake and the tower cannot run); each is that
# family's own arithmetic, checked against a real run by tests/huggingface/probe_classes.py.
_COUNT_WITHOUT_VALUES: dict[str, Callable[[_Maker, int], int]] = {
    # Pixtral: one token per merged block of patch x merge pixels.
    **dict.fromkeys(("mistral3", "lighton_ocr", "mistral_large4"),
                    lambda m, size: (size // (_patch(m) * int(m.need("merge", "spatial_merge_size")))) ** 2),
    **dict.fromkeys(("apertus1p5", "chameleon"), lambda m, size: _vq_side(m, size) ** 2),
    # Emu3 ends each row of codes with an end-of-line token.
    "emu3": lambda m, size: _vq_side(m, size) * (_vq_side(m, size) + 1),
    # LFM2-VL: the SigLIP 2 patches unshuffled by downsample_factor a side.
    "lfm2_vl": lambda m, size: (size // _patch(m) // int(m.need("downsample", "downsample_factor"))) ** 2,
    # MiniCPM-V: merged 2 a side ("4x") or 4 a side (its "16x" mode).
    **dict.fromkeys(("minicpm_ocr", "minicpmv4_6", "minicpmv4_7"),
                    lambda m, size: (size // _patch(m) // (2 if m.get("downsample_mode") == "4x" else 4)) ** 2),
    # Step 3.7: two padded stride-2 convolutions after the tower.
    "step3p7": lambda m, size: _halved(_halved(size // _patch(m))) ** 2,
    **dict.fromkeys(("llava_next", "llava_next_video", "llava_onevision", "granite4_vision"), _anyres_count),
    # BLIP-2's Q-Former: its query tokens, whatever the image (its attention mask reads
    # a value, so it cannot run fake); InstructBLIP-Video: those of each frame.
    **dict.fromkeys(("blip-2", "instructblip"), lambda m, size: _query_tokens(m)),
    "instructblipvideo": lambda m, size: _QFORMER_FRAMES * _query_tokens(m),
}


def _query_tokens(maker: _Maker) -> int:
    return int(maker.need("query tokens", "num_query_tokens"))


def _features_of(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return out
    for name in ("pooler_output", "last_hidden_state"):  # Llama 4 projects its last state
        value = getattr(out, name, None)
        if value is not None:
            return value
    stacked = getattr(out, "deepstack_features", None)
    if stacked:  # Granite 4 Vision: (text layer, features) pairs, each layer's as many
        return stacked[0][1]
    if isinstance(out, (list, tuple)) and out:
        return _features_of(out[0])
    return None


def _tokens(maker: _Maker, per: int, start: str | None = "vision_start_token_id",
            end: str | None = "vision_end_token_id", token: int | None = None,
            kind: int = _IMAGE) -> tuple[list[int], list[int]]:
    """One item's block: ``per`` placeholders (``token``, default the image token) of
    modality ``kind``, between the config's start and end tokens where it names them
    (they keep two images apart: a 3-D RoPE takes a run of image tokens for one image)."""
    token = token if token is not None else _image_token(maker)
    first = maker.get(start) if start else None
    last = maker.get(end) if end else None
    block = ([first] if first is not None else []) + [token] * per + ([last] if last is not None else [])
    kinds = ([_TEXT] if first is not None else []) + [kind] * per + ([_TEXT] if last is not None else [])
    return block, kinds


def _square(maker: _Maker, request: _Request, count: int, default: int | None = None) -> torch.Tensor:
    size = _image_size(maker, request, default)
    return maker.floats(count, _channels(maker), size, size)


def _square_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Square images of the vision config's size, ``(rows * images, C, S, S)``; as many
    image tokens each as ``get_image_features`` returns features for one."""
    per = _count(maker, "get_image_features", {"pixel_values": _square(maker, request, 1)},
                 _image_size(maker, request))
    return _Media({"pixel_values": _square(maker, request, rows * request.images)}, *_tokens(maker, per))


def _declared_count(maker: _Maker) -> int | None:
    """The image tokens per image a model declares (Idefics 3: ``image_seq_len``;
    Idefics 2: its resampler's latents)."""
    value = maker.attribute("image_seq_len")
    if isinstance(value, int):
        return value
    latents = _find(maker.config, "resampler_n_latents")
    return int(latents) if isinstance(latents, int) else None


def _tiled_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """The Idefics 2/3 family: ``(rows, images, C, S, S)`` with a pixel mask of real
    pixels ``(rows, images, S, S)``. Its tower drops all-zero (padding) images by value,
    so the count is what the model declares, not a run."""
    size = _image_size(maker, request)
    per = _declared_count(maker)
    if per is None:
        raise maker.unknown("the image tokens per image (no image_seq_len or resampler_n_latents)")
    inputs = {"pixel_values": maker.floats(rows, request.images, _channels(maker), size, size),
              "pixel_attention_mask": maker.ones(rows, request.images, size, size, dtype=torch.bool)}
    return _Media(inputs, *_tokens(maker, per, start=None, end=None))


def _tile_mask_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Granite-Docling: tiles ``(rows, images, C, S, S)``, a mask of real tiles
    ``(rows, images)``, and the model's ``image_seq_len`` tokens per tile."""
    size = _image_size(maker, request)
    per = _declared_count(maker)
    if per is None:
        raise maker.unknown("the image tokens per tile (no image_seq_len)")
    inputs = {"pixel_values": maker.floats(rows, request.images, _channels(maker), size, size),
              "pixel_attention_mask": maker.ones(rows, request.images, dtype=torch.bool)}
    return _Media(inputs, *_tokens(maker, per, start=None, end=None))


def _grid_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """The Qwen2-VL family: each image one temporal patch of ``side x side`` patches,
    flattened to one row per patch (the width the tower's patch embedding takes), and
    ``image_grid_thw``. Its tower reads the grid as Python numbers, so the count comes
    from the grid (`_GRID_COUNT`), not a run: ``side**2 / merge**2`` tokens per image,
    between the vision start and end tokens."""
    patch = _patch(maker)
    merge = _merge(maker)
    size = _image_size(maker, request, default=2 * patch * merge)
    side = size // patch
    if size % patch or side % merge:
        raise maker.unknown(f"a patch grid for image_size={size}: it must be a multiple of "
                            f"patch_size * spatial_merge_size = {patch * merge}")
    count = rows * request.images
    per = _GRID_COUNT.get(maker.model_type, lambda s, m: s * s // (m * m))(side, merge)
    layout = _GRID_LAYOUT.get(maker.model_type, "rows")
    grid = [[1, side, side]] * count
    if layout == "patches":
        pixels = maker.floats(count * side * side, _channels(maker), patch, patch)
    elif layout == "merged":
        pixels = maker.floats(count * per, patch * merge, patch * merge, _channels(maker))
        grid = [[1, side // merge, side // merge]] * count
    else:
        pixels = maker.floats(count * side * side, _patch_width(maker, patch))
    if "image_grid_hw" in maker.params:  # a 2-D grid (no temporal patch)
        inputs = {"pixel_values": pixels, "image_grid_hw": maker.ints([g[1:] for g in grid])}
    else:
        inputs = {"pixel_values": pixels, "image_grid_thw": maker.ints(grid)}
    if maker.model_type == "video_llama_3":
        # Its tower merges each image by a factor given per image.
        inputs["image_merge_sizes"] = maker.ints([merge] * count)
    return _Media(inputs, *_tokens(maker, per))


# Tokens per image of the grid families that differ from side**2 / merge**2.
_GRID_COUNT: dict[str, Callable[[int, int], int]] = {
    # Hunyuan-VL adds a separator after each row and a token at each end of the image.
    "hunyuan_vl": lambda side, merge: (side // merge) * (side // merge + 1) + 2,
    # Nemotron-H Omni shuffles 2x2 patches into one token (downsample_ratio 0.5).
    "nemotron_h_omni": lambda side, merge: side * side // 4,
    # HY-V4-VL adds a separator after each row.
    "hy_v4_vl": lambda side, merge: (side // merge) * (side // merge + 1),
}
# Grid families whose pixels are not one flattened row per patch: "patches" (a 2-D
# convolution over (C, patch, patch) patches), "merged" (Inkling 2: one
# (patch*merge, patch*merge, C) block per text token, the grid counted in those blocks).
_GRID_LAYOUT = {"kimi_k25": "patches", "paddleocr_vl": "patches",
                **dict.fromkeys(("inkling2", "inkling2_loop"), "merged")}


def _merge(maker: _Maker) -> int:
    """How many patches a side the tower merges into one token (1: none)."""
    merge = maker.get("spatial_merge_size", "merge_size", "merge_kernel_size", config=_vision(maker))
    if isinstance(merge, (list, tuple)):
        merge = merge[0]
    return int(merge) if isinstance(merge, int) else 1


def _patch_width(maker: _Maker, patch: int) -> int:
    """The values per patch row: channels x temporal depth x patch**2 where the vision
    config names the depth; else what the tower's first layer takes (a linear layer's
    input, or a convolution's channels x kernel), since configs name it differently."""
    vision = _vision(maker)
    temporal = maker.get("temporal_patch_size", config=vision)
    if isinstance(temporal, int):
        return _channels(maker) * temporal * patch * patch
    tower = next((getattr(maker.model, name, None) or getattr(getattr(maker.model, "model", None), name, None)
                  for name in ("visual", "vision_tower", "vision_model", "vision_encoder")
                  if getattr(maker.model, name, None) is not None
                  or getattr(getattr(maker.model, "model", None), name, None) is not None), None)
    for module in (tower.modules() if tower is not None else []):
        if isinstance(module, nn.Linear):
            return int(module.in_features)
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            return int(module.weight[0].numel())
    return _channels(maker) * patch * patch


def _anyres_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """The LLaVA-NeXT family: each image as its base view plus the tiles of the grid
    its size picks from ``image_grid_pinpoints`` (``(images, tiles, C, T, T)`` for the
    tower's tile size ``T``) with ``image_sizes``; the count from one run."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    size = _image_size(maker, request)
    tile = _image_size(maker, dataclasses.replace(request, image_size=None))
    pinpoints = maker.need("image grid pinpoints", "image_grid_pinpoints")
    tiles = image_size_to_num_patches((size, size), pinpoints, tile)

    def images(n: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": maker.floats(n, tiles, _channels(maker), tile, tile),
                "image_sizes": maker.ints([[size, size]] * n)}
    per = _count(maker, "get_image_features", images(1), size)
    return _Media(images(rows * request.images), *_tokens(maker, per))


def _sized_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Pixtral-tower models (Mistral 3, LightOnOCR) and the VQ image tokenizers of
    Apertus 1.5 and Emu3: square images with their ``image_sizes``; the count from one
    run."""
    size = _image_size(maker, request)

    def images(n: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": _square(maker, request, n), "image_sizes": maker.ints([[size, size]] * n)}
    per = _count(maker, "get_image_features", images(1), size)
    return _Media(images(rows * request.images), *_tokens(maker, per))


def _patch_rows(maker: _Maker, request: _Request, count: int) -> dict[str, torch.Tensor]:
    """SigLIP 2's patchified images: ``(count, patches, C * patch * patch)`` with each
    image's patch grid (``spatial_shapes``) and which patches are real
    (``pixel_attention_mask``: all, every image one square size)."""
    patch = _patch(maker)
    size = _image_size(maker, request, default=4 * patch)
    side = size // patch
    return {"pixel_values": maker.floats(count, side * side, _channels(maker) * patch * patch),
            "pixel_attention_mask": maker.ones(count, side * side),
            "spatial_shapes": maker.ints([[side, side]] * count)}


def _siglip2_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """LFM2-VL: SigLIP 2 patch rows; the count from one run."""
    per = _count(maker, "get_image_features", _patch_rows(maker, request, 1), _image_size(maker, request, 4 * _patch(maker)))
    return _Media(_patch_rows(maker, request, rows * request.images), *_tokens(maker, per))


def _fuyu_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Fuyu: no vision tower, each image's patches flattened into rows
    ``(samples, images * patches, patch * patch * C)`` that one linear layer embeds,
    one image token per patch."""
    patch = _patch(maker)
    size = _image_size(maker, request)
    per = (size // patch) ** 2
    pixels = maker.floats(rows, request.images * per, patch * patch * _channels(maker))
    return _Media({"pixel_values": pixels}, *_tokens(maker, per, start=None, end=None))


def _qformer_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """InstructBLIP: images and each one's instruction for the Q-Former
    (``qformer_input_ids`` of its own vocabulary); the count from one run."""
    def images(n: int) -> dict[str, torch.Tensor]:
        ids = maker.text(n, _QFORMER_TEXT, maker.vocab(maker.sub("qformer_config")))
        return {"pixel_values": _square(maker, request, n), "qformer_input_ids": maker.ints(ids),
                "qformer_attention_mask": maker.ones(n, _QFORMER_TEXT)}
    per = _count(maker, "get_image_features", images(1), _image_size(maker, request))
    return _Media(images(rows * request.images), *_tokens(maker, per))


_QFORMER_TEXT = 8  # tokens of each image's Q-Former instruction
_QFORMER_FRAMES = 4  # frames of each InstructBLIP-Video clip (the model takes 4)


def _qformer_video(maker: _Maker, request: _Request, rows: int) -> _Media:
    """InstructBLIP-Video: each item a clip ``(frames, C, S, S)`` (the model takes 4
    frames) with its Q-Former instruction; video tokens, counted from one run."""
    size = _image_size(maker, request)

    def clips(n: int) -> dict[str, torch.Tensor]:
        ids = maker.text(n, _QFORMER_TEXT, maker.vocab(maker.sub("qformer_config")))
        return {"pixel_values": maker.floats(n, _QFORMER_FRAMES, _channels(maker), size, size),
                "qformer_input_ids": maker.ints(ids), "qformer_attention_mask": maker.ones(n, _QFORMER_TEXT)}
    per = _count(maker, "get_video_features", clips(1), size)
    token = int(maker.need("video token id", "video_token_index", "video_token_id"))
    return _Media(clips(rows * request.images), *_tokens(maker, per, None, None, token=token))


def _two_resolution_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """DeepSeek-VL hybrid: each image at the vision tower's size and again at the
    high-resolution tower's (``high_res_pixel_values``); the count from one run."""
    high = int(maker.need("high-resolution image size", "image_size", config=maker.sub("high_res_vision_config")))

    def images(n: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": _square(maker, request, n),
                "high_res_pixel_values": maker.floats(n, _channels(maker), high, high)}
    per = _count(maker, "get_image_features", images(1))
    return _Media(images(rows * request.images), *_tokens(maker, per))


def _packed_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """MiniCPM-V: every image's patches packed side by side into one row
    ``(1, C, patch, patches * patch)`` (the model reads the first row only) with each
    image's size in patches (``target_sizes``); the count from one run."""
    patch = _patch(maker)
    side = _image_size(maker, request) // patch

    def images(n: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": maker.floats(1, _channels(maker), patch, n * side * side * patch),
                "target_sizes": maker.ints([[side, side]] * n, dtype=torch.int32)}
    per = _count(maker, "get_image_features", images(1), side * patch)
    return _Media(images(rows * request.images), *_tokens(maker, per))


def _mllama_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Mllama: each image one tile of ``max_num_tiles`` (aspect ratio 1:1, id 1), one
    image token each; the text cross-attends to the images, every token to every
    image's tile (``cross_attention_mask``, set once the sequence length is known)."""
    tiles = int(maker.need("tiles per image", "max_num_tiles", config=_vision(maker)))
    size = _image_size(maker, request)
    images = request.images
    tile_mask = [[[1] + [0] * (tiles - 1)] * images] * rows
    inputs = {"pixel_values": maker.floats(rows, images, tiles, _channels(maker), size, size),
              "aspect_ratio_ids": maker.ints([[1] * images] * rows),
              "aspect_ratio_mask": maker.ints(tile_mask)}

    def finish(out: dict[str, Any], kinds: list[list[int]]) -> None:
        seq = out["input_ids"].shape[1]
        out["cross_attention_mask"] = maker.ints([[tile_mask[0]] * seq] * rows)
    return _Media(inputs, *_tokens(maker, 1, None, None), finish=finish)


def _idefics_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Idefics: images ``(rows, images, C, S, S)`` the text cross-attends to, every
    token to every image (``image_attention_mask``); no placeholder tokens."""
    size = _image_size(maker, request)
    inputs = {"pixel_values": maker.floats(rows, request.images, _channels(maker), size, size)}

    def finish(out: dict[str, Any], kinds: list[list[int]]) -> None:
        out["image_attention_mask"] = maker.ones(rows, out["input_ids"].shape[1], request.images)
    return _Media(inputs, [], [], finish=finish)


def _position_mask_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Kosmos-2: one image per sample whose ``latent_query_num`` features replace the
    embeddings where ``image_embeds_position_mask`` is 1 (the ids there are ordinary
    tokens the processor would have put)."""
    if request.images != 1:
        raise maker.unknown(f"how to place {request.images} images per sample (it takes one)")
    per = int(maker.need("image tokens", "latent_query_num"))
    inputs = {"pixel_values": _square(maker, request, rows)}
    return _Media(inputs, maker.text(1, per)[0], [_IMAGE] * per, finish=_mark_positions(maker))


def _mark_positions(maker: _Maker) -> Callable[[dict[str, Any], list[list[int]]], None]:
    """A finish that marks the image tokens in ``image_embeds_position_mask``."""
    def finish(out: dict[str, Any], kinds: list[list[int]]) -> None:
        out["image_embeds_position_mask"] = maker.ints([[int(k == _IMAGE) for k in row] for row in kinds])
    return finish


def _flattened_patches(maker: _Maker, count: int, side: int, width: int) -> torch.Tensor:
    """Pix2Struct-style patches ``(count, side**2, 2 + width)``: each row's 1-based row
    and column index (read as embedding indices), then its pixels."""
    index = [[[float(1 + i // side), float(1 + i % side)] for i in range(side * side)]] * count
    positions = maker.ints(index, dtype=maker.dtype)
    return torch.cat([positions, maker.floats(count, side * side, width)], dim=-1)


def _kosmos25_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Kosmos-2.5: Pix2Struct-style flattened patches with the image's ``width`` and
    ``height``, its ``latent_query_num`` features where ``image_embeds_position_mask``
    is 1."""
    if request.images != 1:
        raise maker.unknown(f"how to place {request.images} images per sample (it takes one)")
    width = int(maker.need("patch width", "patch_embed_hidden_size", config=_vision(maker)))
    per = int(maker.need("image tokens", "latent_query_num"))
    side = 4
    inputs = {"flattened_patches": _flattened_patches(maker, rows, side, width),
              "width": maker.ints([side * 16] * rows), "height": maker.ints([side * 16] * rows)}
    return _Media(inputs, maker.text(1, per)[0], [_IMAGE] * per, finish=_mark_positions(maker))


def _pooled_crops(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Molmo 2: each image one crop of ``side x side`` patch rows
    ``(images, side**2, C * patch**2)``; each image token pools a 2x2 block of patches
    (``image_token_pooling``: indices into all crops' patches) and ``image_grids``
    says each image has ``(side/2)**2`` such tokens (high resolution only). Its pooling
    drops padding tokens by value, so the count is that grid's, not a run's."""
    patch = _patch(maker)
    side = _image_size(maker, request) // patch
    if side % 2:
        raise maker.unknown(f"2x2 pooling of a {side}x{side} patch grid (use an even number of patches a side)")
    count = rows * request.images
    half = side // 2
    pooling = [[image * side * side + (2 * r + dr) * side + 2 * c + dc for dr in (0, 1) for dc in (0, 1)]
               for image in range(count) for r in range(half) for c in range(half)]
    inputs = {"pixel_values": maker.floats(count, side * side, _channels(maker) * patch * patch),
              "image_token_pooling": maker.ints(pooling),
              "image_grids": maker.ints([[half, half, 0, 0]] * count),
              "image_num_crops": maker.ints([1] * count)}
    return _Media(inputs, *_tokens(maker, half * half, "image_start_token_id", "image_end_token_id"))


def _position_id_patches(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Gemma 4: each image ``side**2`` patch rows ``(images, patches, C * patch**2)``
    with each patch's (x, y) (``image_position_ids``); the tower pools
    ``pooling_kernel_size**2`` patches into a token, and counts real patches by value,
    so the count is the grid's: ``side**2 / kernel**2``."""
    patch = _patch(maker)
    kernel = int(maker.need("pooling kernel", "pooling_kernel_size", config=_vision(maker)))
    side = _image_size(maker, request, default=2 * kernel * patch) // patch
    if side % kernel:
        raise maker.unknown(f"pooling a {side}x{side} patch grid by {kernel} (use a multiple of {kernel * patch} pixels)")
    count = rows * request.images
    per = (side // kernel) ** 2
    if maker.model_type == "gemma4_unified":
        # No tower: each row is already a merged (patch * kernel)**2 block, one token.
        side, patch = side // kernel, patch * kernel
    positions = [[[x, y] for y in range(side) for x in range(side)]] * count
    inputs = {"pixel_values": maker.floats(count, side * side, _channels(maker) * patch * patch),
              "image_position_ids": maker.ints(positions)}
    return _Media(inputs, *_tokens(maker, per, None, None))


def _phi4_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Phi-4 multimodal: each image a global view plus one crop of ``crop_size`` (its
    ``image_sizes``), ``(images, 2, C, S, S)``, with a mask of real patches
    ``(images, 2, side, side)``. The tower pools 2x2 patches and adds a separator
    after each row and one between the crop and the global view, and reads the mask
    by value, so the count is that arithmetic: ``2 * b * (b + 1) + 1`` for ``b`` pooled
    patches a side."""
    vision = _vision(maker)
    size = _image_size(maker, request)
    crop = int(maker.need("crop size", "crop_size", config=vision))
    if size != crop:
        raise maker.unknown(f"images of {size} pixels with crops of {crop} (the tiling of other sizes)")
    side = size // _patch(maker)
    pooled = (side + side % 2) // 2
    per = 2 * pooled * (pooled + 1) + 1
    count = rows * request.images
    inputs = {"image_pixel_values": maker.floats(count, 2, _channels(maker), size, size),
              "image_sizes": maker.ints([[size, size]] * count),
              "image_attention_mask": maker.ones(count, 2, side, side, dtype=torch.bool)}
    token = int(maker.need("image token id", "image_token_id", config=vision))
    return _Media(inputs, *_tokens(maker, per, None, None, token=token))


def _patch_token_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """NeoMME: no tower, each image's patches flattened into rows
    ``(patches, C * patch**2)`` for the whole batch, one image token per patch."""
    patch = _patch(maker)
    side = _image_size(maker, request, default=4 * patch) // patch
    count = rows * request.images
    pixels = maker.floats(count * side * side, _channels(maker) * patch * patch)
    return _Media({"pixel_values": pixels}, *_tokens(maker, side * side, None, None))


def _patch_cube_images(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Inkling: no grid input, each patch a ``(temporal, patch, patch, C)`` cube (an
    image repeats itself in time) that an MLP folds into one token."""
    patch = _patch(maker)
    temporal = int(maker.get("temporal_patch_size", config=_vision(maker)) or 1)
    side = _image_size(maker, request, default=2 * patch) // patch
    count = rows * request.images * side * side
    pixels = maker.floats(count, temporal, patch, patch, _channels(maker))
    return _Media({"pixel_values": pixels}, *_tokens(maker, side * side, None, None))


def _cross_attended(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Models whose text attends to the image without placeholders (BLIP, GIT): the
    images alone."""
    return _Media({"pixel_values": _square(maker, request, rows * request.images)}, [], [])


# model_type -> the image builder of a family the generic one cannot serve.
_IMAGE_FAMILIES: dict[str, Callable[[_Maker, _Request, int], _Media]] = {
    **dict.fromkeys(("idefics2", "idefics3", "smolvlm", "modernvbert", "ultravbert"), _tiled_images),
    "granite_docling": _tile_mask_images,
    **dict.fromkeys(("llava_next", "llava_next_video", "llava_onevision", "granite4_vision"), _anyres_images),
    **dict.fromkeys(("mistral3", "lighton_ocr", "mistral_large4", "apertus1p5", "emu3"), _sized_images),
    "lfm2_vl": _siglip2_images,
    "fuyu": _fuyu_images,
    **dict.fromkeys(("blip", "git"), _cross_attended),
    "instructblip": _qformer_images,
    "instructblipvideo": _qformer_video,
    "deepseek_vl_hybrid": _two_resolution_images,
    **dict.fromkeys(("minicpm_ocr", "minicpmv4_6", "minicpmv4_7"), _packed_images),
    "mllama": _mllama_images,
    "idefics": _idefics_images,
    "kosmos-2": _position_mask_images,
    "kosmos-2.5": _kosmos25_images,
    "molmo2": _pooled_crops,
    "phi4_multimodal": _phi4_images,
    "neomme": _patch_token_images,
    "inkling_mm_model": _patch_cube_images,
    **dict.fromkeys(("gemma4", "gemma4_unified"), _position_id_patches),
}


def _images(maker: _Maker, request: _Request, rows: int) -> _Media:
    family = _IMAGE_FAMILIES.get(maker.model_type)
    if family is not None:
        return family(maker, request, rows)
    if maker.params & {"image_grid_thw", "image_grid_hw"}:
        return _grid_images(maker, request, rows)
    return _square_images(maker, request, rows)


# -- audio --------------------------------------------------------------------------


def _audio(maker: _Maker) -> Any:
    audio = maker.sub("audio_config", "encoder_config", "audio_encoder_config", "encoder")
    return audio if audio is not None else maker.config


@dataclasses.dataclass(frozen=True)
class _AudioLayout:
    """How a family's audio input is shaped: ``arg`` (its forward argument),
    ``layout`` ("bct": features x frames, "btc": frames x features, "bt": raw
    samples), the config field of the feature count, and the frames (samples) a clip
    has by default."""

    arg: str = "input_features"
    layout: str = "bct"
    features: tuple[str, ...] = ("num_mel_bins", "feature_size")
    frames: int | None = None  # None: 2 * max_source_positions where the encoder has it, else 64


# The families whose audio is not Whisper-style log-mel ``(clips, mel bins, frames)``.
_AUDIO_LAYOUTS: dict[str, _AudioLayout] = {
    "speech_to_text": _AudioLayout(layout="btc", features=("input_feat_per_channel",)),
    **dict.fromkeys(("seamless_m4t", "seamless_m4t_v2"),
                    _AudioLayout(layout="btc", features=("feature_projection_input_dim",))),
    # Parakeet-style encoders (Canary, Cohere ASR, Nemotron): frames x mel bins.
    **dict.fromkeys(("canary", "cohere_asr", "nemo_speechlm"), _AudioLayout(layout="btc")),
    **dict.fromkeys(("granite_speech", "granite_speech_plus"), _AudioLayout(layout="btc", features=("input_dim",))),
    # Raw waveforms through strided convolutions (wav2vec 2 style: 320 samples a frame).
    **dict.fromkeys(("speecht5", "moonshine", "moonshine_streaming", "speech-encoder-decoder"),
                    _AudioLayout(arg="input_values", layout="bt", features=(), frames=3200)),
    # ... with a channel axis (OmniASR's feature encoder, VibeVoice's tokenizers: 3200 samples a token).
    **dict.fromkeys(("omniasr", "vibevoice_asr", "vibevoice"),
                    _AudioLayout(arg="input_values", layout="b1t", features=(), frames=6400)),
    # Qwen3-ASR's encoder reads the frames in windows of 2 * n_window (100).
    "qwen3_asr": _AudioLayout(frames=100),
    # Fun-ASR stacks 7 mel frames into one input row (input_size = mel bins x 7).
    "fun_asr_nano": _AudioLayout(layout="btc", features=("input_size",), frames=16),
}


def _audio_clips(maker: _Maker, request: _Request, count: int) -> dict[str, torch.Tensor]:
    """``count`` clips of the family's audio input (`_AUDIO_LAYOUTS`), with the frame
    mask the forward takes."""
    spec = _AUDIO_LAYOUTS.get(maker.model_type, _AudioLayout())
    frames = _audio_frames(maker, request, spec)
    if spec.layout == "bt":
        out = {spec.arg: maker.floats(count, frames)}
    elif spec.layout == "b1t":
        out = {spec.arg: maker.floats(count, 1, frames)}
    else:
        width = _find(_audio(maker), *spec.features) if spec.features else None  # nested: Nemotron
        if not isinstance(width, int):
            raise maker.unknown(f"the audio feature count (none of {', '.join(spec.features)} is set)")
        if maker.model_type == "speech_to_text":
            width *= int(maker.get("input_channels") or 1)  # channels are stacked into the features
        shape = (count, width, frames) if spec.layout == "bct" else (count, frames, width)
        out = {spec.arg: maker.floats(*shape)}
    mask = next((n for n in ("input_features_mask", "feature_attention_mask") if n in maker.params), None)
    if mask is not None:
        out[mask] = maker.ones(count, frames)
    if "padding_mask" in maker.params:
        # Real samples of the raw audio: MOSS maps features to samples (hop 160).
        samples = frames * 160 if maker.model_type == "moss_transcribe_diarize" else frames
        out["padding_mask"] = maker.ones(count, samples, dtype=torch.bool)
    return out


def _audio_frames(maker: _Maker, request: _Request, spec: _AudioLayout) -> int:
    """Frames (samples) per clip: the request's, else the family's, else
    ``2 * max_source_positions`` for a Whisper-style encoder, which insists on exactly
    that many (two convolutions, the second of stride 2, then one position each)."""
    if request.audio_frames is not None:
        return request.audio_frames
    if spec.frames is not None:
        return spec.frames
    positions = maker.get("max_source_positions", config=_audio(maker))
    return 2 * int(positions) if isinstance(positions, int) else 64


def _conv_chain(maker: _Maker, length: int) -> int:
    """Frames out of a wav2vec 2 feature encoder (``conv_kernel``, ``conv_stride``)."""
    audio = _audio(maker)
    for kernel, stride in zip(audio.conv_kernel, audio.conv_stride, strict=True):
        length = (length - kernel) // stride + 1
    return length


def _windowed_queries(maker: _Maker, frames: int) -> int:
    """Granite Speech: a Q-Former per window of ``window_size`` frames, each window
    ``window_size / downsample_rate`` query tokens."""
    window = int(maker.need("window size", "window_size"))
    rate = int(maker.need("downsample rate", "downsample_rate"))
    return -(-frames // window) * (window // rate)


# Tokens per clip, from its frames, where the parameters are fake and the audio tower
# reads values (masks of valid frames); each the family's own arithmetic, checked
# against a real run by tests/huggingface/probe_classes.py.
_AUDIO_COUNT_WITHOUT_VALUES: dict[str, Callable[[_Maker, int], int]] = {
    # Whisper-style encoders pooled 2x after the stride-2 convolution.
    **dict.fromkeys(("qwen2_audio", "audioflamingo3", "musicflamingo", "voxtral"),
                    lambda m, frames: (_halved(frames) - 2) // 2 + 1),
    # GLM-ASR merges 4 encoder frames into a token.
    "glmasr": lambda m, frames: (_halved(frames) - 4) // 4 + 1,
    # MOSS merges audio_merge_size encoder frames, padding the last group.
    "moss_transcribe_diarize": lambda m, frames: -(-_halved(frames) // int(m.need("merge", "audio_merge_size"))),
    "omniasr": _conv_chain,
    **dict.fromkeys(("granite_speech", "granite_speech_plus"), _windowed_queries),
    # Nemotron: its encoder subsamples by subsampling_factor (rounding up).
    "nemo_speechlm": lambda m, frames: -(-frames // int(_find(_audio(m), "subsampling_factor"))),
    # Fun-ASR: one token per (stacked) input row.
    "fun_asr_nano": lambda m, frames: frames,
    # VibeVoice: one token per hop_length samples of its audio tokenizer.
    **dict.fromkeys(("vibevoice", "vibevoice_asr"),
                    lambda m, samples: -(-samples // _vibevoice_hop(m))),
    # Qwen3-ASR: windows of 2 * n_window frames, 13 tokens each, then the remainder
    # through three stride-2 convolutions.
    "qwen3_asr": lambda m, frames: _qwen3_asr_tokens(int(m.need("window", "n_window", config=_audio(m))), frames),
}


def _vibevoice_hop(maker: _Maker) -> int:
    ratios = _find(maker.config, "downsampling_ratios")
    product = 1
    for ratio in ratios or []:
        product *= int(ratio)
    return product


def _qwen3_asr_tokens(window: int, frames: int) -> int:
    left = frames % (2 * window)
    return _halved(_halved(_halved(left))) + (frames // (2 * window)) * 13 if left else (frames // (2 * window)) * 13


def _audio_tokens(maker: _Maker, clip: dict[str, torch.Tensor], frames: int) -> int:
    """The audio tokens one clip takes: from ``get_audio_features`` run on it where the
    model has one that needs nothing else, else from the audio tower's own output
    length arithmetic (``_get_feat_extract_output_lengths``, run on the frame count).
    With fake parameters, the family's arithmetic (`_AUDIO_COUNT_WITHOUT_VALUES`)."""
    formula = _AUDIO_COUNT_WITHOUT_VALUES.get(maker.model_type)
    if formula is not None and not maker.has_values:
        return formula(maker, frames)
    function = maker.method("get_audio_features")
    required = {name for name, p in inspect.signature(function).parameters.items()
                if p.default is inspect.Parameter.empty and p.kind not in
                (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)} if function else {"-"}
    if function is not None and required <= set(clip):
        return _count(maker, "get_audio_features", clip)
    lengths: Callable[..., Any] | None = next(
        (getattr(m, "_get_feat_extract_output_lengths") for m in maker.model.modules()  # noqa: B009 - a module method
         if callable(getattr(m, "_get_feat_extract_output_lengths", None))), None)
    if lengths is None:
        raise maker.unknown("how many tokens a clip takes (no get_audio_features it can run, "
                            "no _get_feat_extract_output_lengths)")
    with _disable_current_modes():  # arithmetic on a length this module chose
        out = lengths(torch.tensor([frames]))
    out = out[-1] if isinstance(out, tuple) else out
    return int(out.reshape(-1)[0])


def _audio_media(maker: _Maker, request: _Request, rows: int) -> _Media:
    """Audio clips, one per sample; as many audio tokens each as `_audio_tokens`."""
    frames = _audio_frames(maker, request, _AUDIO_LAYOUTS.get(maker.model_type, _AudioLayout()))
    per = _audio_tokens(maker, _audio_clips(maker, request, 1), frames)
    token = int(maker.need("audio token id", "audio_token_id", "audio_token_index"))
    clips = _audio_clips(maker, request, rows)
    if maker.model_type in ("granite_speech", "granite_speech_plus"):
        # Granite Speech's mask is over the projected features (one per audio token).
        clips["input_features_mask"] = maker.ones(rows, per, dtype=torch.bool)
    return _Media(clips, *_tokens(maker, per, "audio_start_token_id", "audio_end_token_id", token=token,
                                  kind=_AUDIO))


def _additive_audio(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Voxtral Realtime: streaming, each text position adds the audio embedding of its
    time step (no placeholders), so a clip is ``audio_length_per_tok`` frames per
    token of ``seq``; it reads audio in every batch."""
    if not request.media:
        _refuse_text_only(maker, "its forward requires input_features (each token adds its audio frame)")
    per_token = int(maker.need("frames per token", "audio_length_per_tok"))
    mels = _find(_audio(maker), "num_mel_bins")
    if not isinstance(mels, int):
        raise maker.unknown("the mel bins (no num_mel_bins in its audio config)")
    ids = maker.text(request.batch, request.seq)
    return {"input_ids": maker.ints(ids), "attention_mask": maker.ones(request.batch, request.seq),
            "labels": maker.ints(ids), "input_features": maker.floats(request.batch, mels, request.seq * per_token)}


def _codebook_stream(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Kyutai speech-to-text: each position holds a text token and one code of each of
    ``num_codebooks`` audio codebooks (``(batch, seq, 1 + codebooks)``, embedded and
    summed); the labels are the text."""
    codebooks = int(maker.need("codebooks", "num_codebooks"))
    size = int(maker.need("codebook vocabulary", "codebook_vocab_size"))
    text = maker.text(request.batch, request.seq)
    codes = maker.draw(0, size - 1, (request.batch, request.seq, codebooks)) if request.media else \
        [[[int(maker.need("audio pad", "audio_pad_token_id"))] * codebooks] * request.seq] * request.batch
    ids = [[[t] + c for t, c in zip(row, row_codes, strict=True)] for row, row_codes in zip(text, codes, strict=True)]
    return {"input_ids": maker.ints(ids), "attention_mask": maker.ones(request.batch, request.seq),
            "labels": maker.ints(text)}


def _dia(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Dia (text to speech): text for the encoder; for the decoder, ``num_channels``
    codebooks of audio codes flattened into the batch (``(batch * channels, seq)``),
    the labels the same codes, the decoder's inputs them shifted behind its bos."""
    decoder = maker.sub("decoder_config")
    channels = int(maker.need("codebooks", "num_channels", config=decoder))
    encoder_vocab = maker.vocab(maker.sub("encoder_config"))
    codes = maker.text(request.batch * channels, request.seq, maker.vocab(decoder))
    start = int(maker.need("decoder start", "bos_token_id", config=decoder))
    shifted = [[start] + row[:-1] for row in codes]
    # The decoder's inputs as (batch, seq, channels): Dia turns a 2-D one into a transposed
    # view that its embedding cannot view (transformers 5.24).
    steps = [[[shifted[b * channels + c][t] for c in range(channels)] for t in range(request.seq)]
             for b in range(request.batch)]
    return {"input_ids": maker.ints(maker.text(request.batch, request.seq, encoder_vocab)),
            "attention_mask": maker.ones(request.batch, request.seq),
            "decoder_input_ids": maker.ints(steps), "labels": maker.ints(codes)}


def _speech_seq2seq(maker: _Maker, request: _Request) -> dict[str, Any]:
    """A speech encoder-decoder: the clips for the encoder, labels for the decoder."""
    if not request.media:
        _refuse_text_only(maker, "its encoder reads only audio")
    return _seq2seq_labels(maker, request, _audio_clips(maker, request, request.batch))


# -- assembling ---------------------------------------------------------------------


def _media_ids(maker: _Maker, request: _Request, media: _Media | None, items: int
               ) -> tuple[dict[str, Any], list[list[int]]]:
    """Ids holding each sample's ``items`` blocks of ``media`` first, then text, all
    ``seq`` long; labels that ignore the blocks (masked-LM targets on the text of a
    masked LM); ``mm_token_type_ids`` where forward takes it. Also every sample's
    token modalities."""
    block = media.block * items if media is not None else []
    kinds = media.kinds * items if media is not None else []
    if len(block) >= request.seq:
        raise ExampleInputsError(f"{maker.name}: {items} item(s) of {len(block) // max(items, 1)} tokens "
                                 f"each need seq > {len(block)}, got seq={request.seq}")
    ids, labels, types = [], [], []
    masked = _is_masked_lm(maker)
    for row in maker.text(request.batch, request.seq - len(block)):
        ids.append(block + row)
        labels.append([IGNORE] * len(block) + (_masked_targets([row])[0] if masked else row))
        types.append(kinds + [_TEXT] * len(row))
    out: dict[str, Any] = {"input_ids": maker.ints(ids), "attention_mask": maker.ones(request.batch, request.seq),
                           "labels": maker.ints(labels)}
    if "mm_token_type_ids" in maker.params:  # Molmo 2 wants it in training, images or not
        out["mm_token_type_ids"] = maker.ints(types)
    return out, types


def _media_batch(maker: _Maker, request: _Request, build: Callable[[_Maker, _Request, int], _Media],
                 items: int) -> dict[str, Any]:
    """A batch with ``items`` media items per sample (none for a text-only request):
    the decoder's, or for an encoder-decoder the encoder's with labels for the
    decoder."""
    if not request.media:
        _refuse_text_only(maker)
    media = build(maker, request, request.batch) if request.media else None
    out, kinds = _media_ids(maker, request, media, items)
    if media is not None:
        out.update(media.inputs)
        if media.finish is not None:
            media.finish(out, kinds)
    if getattr(maker.config, "is_encoder_decoder", False):
        del out["labels"]
        return _seq2seq_labels(maker, request, out)
    return out


# Models that cannot run a batch without images, and why (transformers 5.24).
_IMAGES_ALWAYS = {
    "git": "its loss skips the image tokens' logits whether or not an image is given",
    "idefics": "its forward requires one of pixel_values, image_encoder_embeddings or perceiver_embeddings",
    "kosmos-2": "its forward requires pixel_values or image_embeds",
}


def _refuse_text_only(maker: _Maker, reason: str | None = None) -> None:
    """Refuse ``with_images=False`` for a model that takes its media in every batch."""
    reason = reason or _IMAGES_ALWAYS.get(maker.model_type)
    if reason is None:
        pixel = inspect.signature(maker.model.forward).parameters.get("pixel_values")
        if pixel is not None and pixel.default is inspect.Parameter.empty:
            reason = "its forward requires pixel_values"
    if reason is not None:
        raise ExampleInputsError(f"{maker.name} takes its images or audio in every batch, so "
                                 f"with_images=False cannot be served: {reason}")


def _by_signature(maker: _Maker, request: _Request) -> dict[str, Any]:
    """The batch the forward's parameters and the config call for."""
    params = maker.params
    if "ImageClassification" in maker.name:
        return _image_classification(maker, request)
    if "input_ids" not in params and params & AUDIO_INPUTS:
        return _speech_seq2seq(maker, request)
    if "input_ids" not in params:
        raise maker.unknown("its inputs (forward takes neither input_ids nor a family this module knows)")
    if params & IMAGE_INPUTS:
        return _media_batch(maker, request, _images, request.images)
    if params & AUDIO_INPUTS and not getattr(maker.config, "is_encoder_decoder", False):
        return _media_batch(maker, request, _audio_media, 1)
    if getattr(maker.config, "is_encoder_decoder", False):
        encoder = {"input_ids": maker.ints(maker.text(request.batch, request.seq)),
                   "attention_mask": maker.ones(request.batch, request.seq)}
        return _seq2seq_labels(maker, request, encoder)
    return _text_batch(maker, request)


# -- image classification ------------------------------------------------------------


def _image_classification(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Images of the config's size (or what the family takes) and a class label each."""
    labels = maker.ints(maker.draw(0, int(getattr(maker.config, "num_labels", 2)), (request.batch,)))
    has_token = _find(maker.config, "image_token_id", "image_token_index") is not None
    if "input_ids" in maker.params and not has_token:
        # ImageGPT: an image is a sequence of colour-cluster ids, not pixels.
        return {"input_ids": maker.ints(maker.text(request.batch, request.seq)), "labels": labels}
    if "input_ids" in maker.params:
        # ShieldGemma 2: a vision-language model whose answer logits are the classes; its
        # labels are its language model's, which its forward passes on.
        return _media_batch(maker, request, _images, request.images)
    if "pixel_values" not in maker.params:
        raise maker.unknown("its image input (forward takes no pixel_values)")
    if "spatial_shapes" in maker.params:
        return {**_patch_rows(maker, request, request.batch), "labels": labels}
    return {"pixel_values": _square(maker, request, request.batch, default=32), "labels": labels}


# -- whole-batch families --------------------------------------------------------------

_Family = Callable[[_Maker, _Request], dict[str, Any]]


def _encoder_images(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Encoder-decoders whose encoder reads only an image (vision encoder-decoder,
    PP-FormulaNet): the images and labels for the decoder."""
    if not request.media:
        _refuse_text_only(maker, "its encoder reads only images")
    return _seq2seq_labels(maker, request, {"pixel_values": _square(maker, request, request.batch)})


def _pix2struct(maker: _Maker, request: _Request) -> dict[str, Any]:
    """Pix2Struct: its encoder reads flattened patches with their row and column
    indices, ``(batch, patches, 2 + patch_embed_hidden_size)``, and their mask."""
    if not request.media:
        _refuse_text_only(maker, "its encoder reads only images")
    width = int(maker.need("patch width", "patch_embed_hidden_size", config=_vision(maker)))
    side = 4
    encoder = {"flattened_patches": _flattened_patches(maker, request.batch, side, width),
               "attention_mask": maker.ones(request.batch, side * side)}
    return _seq2seq_labels(maker, request, encoder)


def _udop(maker: _Maker, request: _Request) -> dict[str, Any]:
    """UDOP: the encoder reads text with each token's bounding box (``bbox``,
    normalized to [0, 1]; here one small box for all) and the page image, whose patches
    it joins to the text itself (no placeholders)."""
    encoder = {"input_ids": maker.ints(maker.text(request.batch, request.seq)),
               "attention_mask": maker.ones(request.batch, request.seq),
               "bbox": maker.ints([[[0.0, 0.0, 0.1, 0.1]] * request.seq] * request.batch, dtype=torch.float32)}
    if request.media:
        encoder["pixel_values"] = _square(maker, request, request.batch)
    return _seq2seq_labels(maker, request, encoder)


def _fixed_length(what: str, length: Callable[[Any], int]) -> _Family:
    """A text model that trains on sequences of one length only (``length(config)``)."""
    def build(maker: _Maker, request: _Request) -> dict[str, Any]:
        if "ImageClassification" in maker.name:  # the same family's image heads
            return _by_signature(maker, request)
        needed = length(maker.config)
        if request.seq != needed:
            raise ExampleInputsError(f"{maker.name} trains on sequences of exactly {needed} tokens "
                                     f"({what}); pass seq={needed}, got seq={request.seq}")
        return _by_signature(maker, request)
    return build


_FAMILIES: dict[str, _Family] = {
    **dict.fromkeys(("vision-encoder-decoder", "pp_formulanet"), _encoder_images),
    "pix2struct": _pix2struct,
    "udop": _udop,
    "reformer": _fixed_length("in training its axial position embeddings cover axial_pos_shape's product",
                              lambda config: int(config.axial_pos_shape[0] * config.axial_pos_shape[1])),
    "voxtral_realtime": _additive_audio,
    "dia": _dia,
    "kyutai_speech_to_text": _codebook_stream,
    "perceiver": _fixed_length("its masked-LM decoder has max_position_embeddings output positions",
                               lambda config: int(config.max_position_embeddings)),
}
