"""What a traced training step is fed: the inputs each kind of model takes, and its loss.

A memory trace (`annot.memory.activations`) runs one training step of the model under
``FakeTensorMode``. What the step holds depends on its inputs: a vision-language model's
tower runs only on images, a speech model's encoder takes mel features, a diffusion
transformer takes noisy latents and predicts a velocity (a flow-matching loss, not a
token loss). An inputs function (`InputsFn`) gives ``(args, kwargs)`` of one forward,
or ``(args, kwargs, loss)`` where ``loss(output)`` is the step's loss (else the output's
``loss``, or the sum of its first floating tensor: `default_loss`).

- `default_inputs`: token ids (text models; pure vision models get images).
- `model_inputs`: the inputs each class really takes (`MediaSizes` says the images',
  audio's and latents' sizes): `annot.huggingface.example_inputs.training_inputs` for a
  transformers model that takes images, audio, decoder inputs or masked-LM labels,
  `annot.huggingface.denoiser_inputs.denoiser_inputs` and its flow-matching loss for a
  diffusers model, `default_inputs` otherwise.
- `example_batch`: the user's own batch (`estimate_memory(..., example_inputs=...)`),
  traced as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["InputsFn", "MediaSizes", "default_inputs", "default_loss", "example_batch", "model_inputs",
           "step_inputs"]

InputsFn = Callable[[nn.Module, int, int], tuple[Any, ...]]
LossFn = Callable[[Any], torch.Tensor]
#: Forward arguments that carry a modality other than text, or the other half of a
#: sequence-to-sequence model: a model taking one is fed by `model_inputs`' builders.
_MEDIA_ARGUMENTS = ("pixel_values", "pixel_values_videos", "input_features", "input_values",
                    "decoder_input_ids")


def default_inputs(model: nn.Module, batch: int, seq: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids of shape (batch, seq), all one ordinary token (`_ordinary_token`), as
    the model's first input, and as its targets or labels when ``forward`` takes them (so
    the loss's saved tensors count too);
    ``use_cache=False`` where ``forward`` takes it, as in training. Vision
    models (a ``pixel_values`` input and no ``input_ids``) get images of the configured
    size instead: a model taking both (Fuyu: images optional) is traced on text."""
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)
    if "pixel_values" in params and "input_ids" not in params and config is not None:
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        return (), {"pixel_values": torch.zeros(batch, channels, size, size)}
    ids = torch.full((batch, seq), _ordinary_token(config), dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if "use_cache" in params:
        # A training step keeps no key/value cache (annot passes use_cache=False to
        # training forwards that checkpoint, pitfall 14); transformers' default, the
        # config's True, builds one, and Bamba, Dory and xLSTM fail in it (issue #29).
        kwargs["use_cache"] = False
    if "input_ids" in params:
        kwargs["input_ids"] = ids
        if "decoder_input_ids" in params:  # encoder-decoder: as long a target as the source
            kwargs["decoder_input_ids"] = ids
        if "labels" in params and not getattr(config, "is_encoder_decoder", False):
            kwargs["labels"] = ids
        return (), kwargs
    if "targets" in params:
        return (ids, ids), {}
    return (ids,), {}


def _ordinary_token(config: Any) -> int:
    """The smallest token id that none of ``config``'s special tokens has (padding,
    begin, end, mask, image, ...: every ``*_token_id``, ``*_token_index`` and ``*_index``
    field): the trace's token ids. Their values matter only to a model that reads them
    (XLM counts its non-padding tokens), traced with `ValueShadows`."""
    special: set[int] = set()
    for name, value in (vars(config).items() if config is not None and hasattr(config, "__dict__") else ()):
        if name.endswith(("token_id", "token_ids", "token_index", "_index")):
            values = value if isinstance(value, (list, tuple)) else [value]
            special.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return next(i for i in range(len(special) + 1) if i not in special)


@dataclasses.dataclass(frozen=True)
class MediaSizes:
    """The sizes of what a traced step feeds besides tokens (``None``: the model's own
    default). ``image_size``: pixels of a square image (a vision-language or image
    model; default the vision config's); ``images``: images per sample; ``audio_frames``:
    a speech or audio model's input frames (default what its encoder requires);
    ``latent_size``, ``frames``, ``text_tokens``: a diffusion transformer's latent height
    and width before patching, latent frames (video), prompt tokens."""

    image_size: int | None = None
    images: int = 1
    audio_frames: int | None = None
    latent_size: int | None = None
    frames: int | None = None
    text_tokens: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field.name} must be a positive whole number, got {value!r}")

    def describe(self, model: nn.Module, batch: int, seq: int) -> str:
        """The inputs `model_inputs` feeds ``model``, in words (printed under the table)."""
        from annot.huggingface.model import is_diffusers_model

        if is_diffusers_model(model):
            video = f" x {self.frames} frames" if self.frames else ""
            return (f"traced on a flow-matching step of {batch} noisy latent(s) of "
                    f"{self.latent_size or 'the default'} px a side{video} and "
                    f"{self.text_tokens or 'the default number of'} prompt tokens")
        built: dict[str, Any] | None
        try:
            built = _built_inputs(model, batch, seq, self)
        except Exception:  # noqa: BLE001 - said where the trace fails, if it does: a tower
            # that reads a value of its inputs (Aria's, InstructBLIP's attention masks) cannot
            # count its tokens on the meta device, where the trace's fake copy can
            built = {}
        if built is None:
            return ""  # token ids: the table's header says batch and seq
        parts = [f"{batch} sample(s) of {seq} tokens"]
        if _takes(model, "pixel_values"):
            size = f"{self.image_size} px" if self.image_size else "the vision config's size"
            parts.append(f"{self.images} image(s) of {size} each (their tokens among the {seq})")
        if _takes(model, "input_features") or _takes(model, "input_values"):
            audio = str(self.audio_frames) if self.audio_frames else "the encoder's default number of"
            parts.append(f"audio of {audio} frames")
        return "traced on " + ", ".join(parts)


def default_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output (a 0-d tensor: a tuple's or ``.loss``), else the sum
    of the first floating output."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple())
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    scalars = [t for t in leaves if t.dim() == 0]
    if scalars:
        return scalars[0]
    if not leaves:
        raise ValueError("the model's output holds no floating tensor to take a loss of")
    return leaves[0].float().sum()


def _takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _fed_by_builders(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model whose step `training_inputs` builds:
    one that takes images, audio or decoder inputs, a masked LM (masked labels), or an
    image classifier (a label per sample; ImageGPT's takes its pixels as token ids)."""
    from annot.huggingface.model import is_pretrained_model

    if not is_pretrained_model(model):
        return False
    config = getattr(model, "config", None)
    return (any(_takes(model, name) for name in _MEDIA_ARGUMENTS)
            or bool(getattr(config, "is_encoder_decoder", False))
            or type(model).__name__.endswith(("ForMaskedLM", "ForImageClassification")))


def _built_inputs(model: nn.Module, batch: int, seq: int, sizes: MediaSizes) -> dict[str, Any] | None:
    """`training_inputs`' batch for a model the builders feed (`_fed_by_builders`), or for
    a conditional-generation class where they serve it (Kyutai's speech-to-text takes its
    audio as token ids of one more axis, a codebook each); ``None``: token ids do. A
    multimodal class built without its tower (the causal-LM sweep's Gemma 4 from a text
    config) takes text only; one with a tower the builders cannot serve is refused
    (`ExampleInputsError`), never traced on text alone."""
    from annot.huggingface.example_inputs import ExampleInputsError, training_inputs
    from annot.huggingface.model import is_pretrained_model
    from annot.policies.roles import TOWERS, module_roles

    if not (_fed_by_builders(model) or (is_pretrained_model(model)
                                        and type(model).__name__.endswith("ForConditionalGeneration"))):
        return None
    try:
        return training_inputs(model, batch=batch, seq=seq, image_size=sizes.image_size,
                               images_per_sample=sizes.images, audio_frames=sizes.audio_frames)
    except ExampleInputsError:
        if any(role in TOWERS for role in module_roles(model).values()):
            raise
        return None


def model_inputs(sizes: MediaSizes | None = None) -> InputsFn:
    """An `InputsFn` feeding each model what its class takes (module docstring); the
    step's loss is the model's own (transformers: ``labels``) or the flow-matching loss
    of a diffusers denoiser."""
    sizes = sizes or MediaSizes()

    def inputs(model: nn.Module, batch: int, seq: int) -> tuple[Any, ...]:
        from annot.huggingface.model import is_diffusers_model

        if is_diffusers_model(model):
            from annot.huggingface.denoiser_inputs import denoiser_inputs, prediction_loss

            kwargs, target = denoiser_inputs(model, batch=batch, latent_size=sizes.latent_size,
                                             frames=sizes.frames, text_tokens=sizes.text_tokens)
            return (), kwargs, lambda output: prediction_loss(model, output, target)
        built = _built_inputs(model, batch, seq, sizes)
        return ((), built) if built is not None else default_inputs(model, batch, seq)

    return inputs


def example_batch(batch: Mapping[str, Any], loss: LossFn | None = None) -> InputsFn:
    """An `InputsFn` feeding the user's own ``batch`` (keyword arguments of one forward:
    tensors, and any other values) to every trace, whatever batch and sequence length
    the trace asks for; each tensor becomes a fake tensor of its shape, dtype and values
    (values matter to a model that reads them). ``loss(output)`` is the step's loss
    (default `default_loss`)."""
    if not isinstance(batch, Mapping) or not all(isinstance(k, str) for k in batch):
        raise TypeError("example_inputs must be a mapping of forward argument names to values")

    def inputs(model: nn.Module, _batch: int, _seq: int) -> tuple[Any, ...]:
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode()
        convert = (lambda t: mode.from_tensor(t)) if mode is not None else (lambda t: t)
        kwargs = tree_map(lambda v: convert(v) if isinstance(v, torch.Tensor) else v, dict(batch))
        return ((), kwargs, loss) if loss is not None else ((), kwargs)

    return inputs


def batch_and_seq(batch: Mapping[str, Any]) -> tuple[int, int]:
    """The batch size and sequence length of a user's batch, for the report: the first
    dimensions of ``input_ids`` (or of the first tensor of two or more dimensions)."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((t for t in tree_leaves(dict(batch)) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if ids is None:
        return 1, 1
    return int(ids.shape[0]), int(ids.shape[1])


def step_inputs(inputs: InputsFn | None, model: nn.Module, batch: int, seq: int
                ) -> tuple[tuple[Any, ...], dict[str, Any], LossFn]:
    """``(args, kwargs, loss)`` of one traced step from ``inputs`` (default
    `model_inputs`: what the model's class takes), the loss `default_loss` where the
    function names none."""
    given = (inputs or model_inputs())(model, batch, seq)
    if len(given) == 3:
        return given[0], given[1], given[2]
    args, kwargs = given
    return args, kwargs, default_loss
