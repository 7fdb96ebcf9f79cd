"""The inputs of one flow-matching training step for diffusers' transformer denoisers.

`denoiser_inputs` builds, from a model's ``config`` and its class alone, the keyword
arguments of one forward of a diffusers transformer (``FluxTransformer2DModel``,
``SD3Transformer2DModel``, ``WanTransformer3DModel``, ...) and the flow-matching target:
``x0`` clean latents, ``noise ~ N(0, 1)``, ``t`` in ``(0, 1)``, the model sees
``x_t = (1 - t) * x0 + t * noise`` and is trained to predict ``v = noise - x0``.
`flow_matching_loss` runs the forward and takes the mean squared error.

Every class has its own layout (Flux packs 2x2 latent patches into a sequence, SD3 takes
``(B, C, H, W)``, video models ``(B, C, F, H, W)``, ...) and its own timestep scale; each
builder below follows the pipeline diffusers ships for its class and names the file it
read. Only shapes known from the config are used, never a value of the model's tensors,
so the same call works when the parameters are ``FakeTensor``s (annot's memory planner
traces a step under ``FakeTensorMode``): call it inside the mode and the inputs are fake
too. A class no builder serves is refused with a ``ValueError`` naming it and why.

diffusers is imported inside the functions that need it: importing this module is light.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["denoiser_inputs", "flow_matching_loss", "prediction_loss", "served_classes"]

DEFAULT_LATENT = 8  # latent height = width, before any patching: 2x2 packing leaves a 4x4 grid
DEFAULT_FRAMES = 2  # latent frames of a video model
DEFAULT_TEXT = 8  # text tokens

Config = Mapping[str, Any]


class _Draw:
    """The random tensors of one call, drawn in a fixed order from one generator: the
    timestep first, then each noisy stream's clean latents and noise, then the
    conditioning. Draws are float32 on the CPU generator's device (so a seed gives the
    same numbers whatever the model's device) and then moved and cast."""

    def __init__(self, *, model: nn.Module, name: str, batch: int, generator: torch.Generator | None,
                 device: torch.device, dtype: torch.dtype, latent: int, frames: int, text: int) -> None:
        self.model = model  # for the few classes whose own methods build an input (never its values)
        self.name = name
        self.batch = batch
        self.generator = generator
        self.device = device
        self.dtype = dtype
        self.latent = latent
        self.frames = frames
        self.text = text
        self.targets: list[torch.Tensor] = []
        # t in [0, 1): noise level of flow matching, 1 = pure noise (diffusers' sigma).
        self.t = self._draw(torch.rand, (batch,))

    def _draw(self, fn: Callable[..., torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        out = fn(shape, generator=self.generator, dtype=torch.float32,
                 device=self.generator.device if self.generator is not None else "cpu")
        return out.to(self.device)

    def normal(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._draw(torch.randn, shape).to(dtype or self.dtype)

    def noisy(self, *shape: int) -> torch.Tensor:
        """``x_t`` of a stream laid out as ``shape`` (the batch first); its target
        ``noise - x0`` is recorded in float32."""
        x0 = self._draw(torch.randn, shape)
        noise = self._draw(torch.randn, shape)
        t = self.t.view(-1, *[1] * (len(shape) - 1))
        self.targets.append(noise - x0)
        return ((1 - t) * x0 + t * noise).to(self.dtype)

    def time(self, scale: float = 1.0, *, reverse: bool = False, cast: bool = False) -> torch.Tensor:
        """The timestep a pipeline passes: ``t * scale``, or ``(1 - t) * scale`` for the
        classes whose time runs from noise (0) to data (1); float32, or in the latents'
        dtype (``cast``) where the pipeline casts it and the model relies on that."""
        out = ((1 - self.t) if reverse else self.t) * scale
        return out.to(self.dtype) if cast else out

    def integers(self, high: int, *shape: int) -> torch.Tensor:
        """Uniform integers in ``[0, high)`` (class labels, token ids)."""
        device = self.generator.device if self.generator is not None else "cpu"
        return torch.randint(0, high, shape, generator=self.generator, device=device).to(self.device)

    def texts(self, width: int, tokens: int | None = None) -> torch.Tensor:
        return self.normal(self.batch, tokens or self.text, width)

    def ones(self, *shape: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=self.device)

    def zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    def full(self, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((self.batch,), value, dtype=dtype, device=self.device)

    def arange(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.arange(n, dtype=dtype, device=self.device)

    def grid(self, *sizes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(prod(sizes), len(sizes))`` coordinates of a grid, row-major."""
        axes = torch.meshgrid(*(self.arange(n, dtype) for n in sizes), indexing="ij")
        return torch.stack(axes, dim=-1).reshape(-1, len(sizes))

    def refuse(self, why: str) -> ValueError:
        return ValueError(f"{self.name}: {why}")

    def divisible(self, size: int, by: int, what: str) -> int:
        if size % by:
            raise self.refuse(f"{what} {size} is not a multiple of {by}; pass latent_size/frames that are")
        return size // by

    def target(self) -> torch.Tensor:
        """The recorded targets: the one stream's, or every stream's flattened and joined
        (video and audio models predict both)."""
        if len(self.targets) == 1:
            return self.targets[0]
        return torch.cat([t.flatten(1) for t in self.targets], dim=1)


Builder = Callable[[_Draw, Config], dict[str, Any]]
Predict = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Spec:
    build: Builder
    predict: Predict


_SPECS: dict[str, _Spec] = {}
# Classes under diffusers.models.transformers that are not denoisers, or whose forward
# cannot take a training step; each says why.
_REFUSED: dict[str, str] = {
    "WanAnimate2Transformer3DModel": "one denoising step is two forwards: a reference pass (kv_cache_mode="
                                     "'extract') fills the WanAnimate2KVCache that the generation pass "
                                     "('cached') reads; the kwargs of one forward cannot hold it",
    "MiniMaxMusic3RVQDepthDecoder": "not a denoiser: the depth decoder of MiniMax-Music's residual "
                                    "codebooks maps embeddings to hidden states for codebook heads; it has no "
                                    "noisy input and no velocity to predict",
}


def _first(output: Any) -> Any:
    """The prediction of a forward: the first element of a tuple or list, the ``sample``
    (or the first field) of an output object, or the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    if hasattr(output, "sample") and output.sample is not None:
        return output.sample
    if hasattr(output, "to_tuple"):
        return output.to_tuple()[0]
    raise TypeError(f"cannot find the prediction in a {type(output).__name__}")


def _same(output: Any, target: torch.Tensor) -> torch.Tensor:
    return _first(output)


def _learned_sigma(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Classes that also predict a variance (``learn_sigma``): twice the channels; the
    pipelines keep the first half (e.g. pipelines/dit/pipeline_dit.py)."""
    pred = _first(output)
    if pred.ndim >= 2 and pred.shape[1] == 2 * target.shape[1]:
        return pred[:, : target.shape[1]]
    return pred


def _negated(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Classes whose pipeline negates the prediction before the scheduler step: they
    predict ``x0 - noise``."""
    return -_first(output)


def _streams(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Video and audio predictions, flattened and joined as `_Draw.target` joins them."""
    parts = output.to_tuple() if hasattr(output, "to_tuple") else output
    return torch.cat([p.flatten(1) for p in parts if isinstance(p, torch.Tensor)], dim=1)


def _negated_sigma(output: Any, target: torch.Tensor) -> torch.Tensor:
    return -_learned_sigma(output, target)


def _serves(*names: str, predict: Predict = _same) -> Callable[[Builder], Builder]:
    def register(build: Builder) -> Builder:
        for name in names:
            _SPECS[name] = _Spec(build, predict)
        return build
    return register


def served_classes() -> tuple[str, ...]:
    """The diffusers class names `denoiser_inputs` builds inputs for."""
    return tuple(sorted(_SPECS))


def _spec(model: nn.Module) -> tuple[str, _Spec]:
    for cls in type(model).__mro__:  # a subclass of a served class is served the same way
        if cls.__name__ in _SPECS:
            return cls.__name__, _SPECS[cls.__name__]
        if cls.__name__ in _REFUSED:
            raise ValueError(f"{cls.__name__}: {_REFUSED[cls.__name__]}")
    raise ValueError(f"{type(model).__name__}: no training-step inputs for this class; annot builds them for "
                     f"diffusers' transformer denoisers ({len(_SPECS)} classes, see served_classes())")


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most parameter elements have (metadata only: fake parameters
    work); modules kept in float32 beside a bfloat16 body do not decide it."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        # A model built on the meta device is traced on fake CPU tensors.
        return torch.device("cpu") if p.device.type == "meta" else p.device
    return torch.device("cpu")


def denoiser_inputs(model: nn.Module, *, batch: int, generator: torch.Generator | None = None,
                    latent_size: int | None = None, frames: int | None = None, text_tokens: int | None = None,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    ) -> tuple[dict[str, Any], torch.Tensor]:
    """The keyword arguments of one forward of ``model`` (a diffusers transformer
    denoiser) and its flow-matching target ``noise - x0``.

    ``latent_size`` is the latent height and width before any patching (default 8),
    ``frames`` the latent frames of a video model (default 2), ``text_tokens`` the prompt
    length (default 8; classes with a fixed text length take theirs from the config).
    Random tensors come from ``generator`` (the global one when None) in a fixed order, so
    one seed gives one step. Floating inputs take ``dtype`` (default: the dtype most
    parameters have) and live on ``device`` (default: the parameters', or the CPU for a
    meta-device model). The kwargs ask for a plain tuple (``return_dict=False``) where the
    forward has that switch.

    The target is in the layout the model predicts in (packed tokens for Flux, ``(B, C,
    H, W)`` for SD3, ...), float32; for a model predicting two streams (video and audio)
    it is both flattened and joined along dim 1. Raises ``ValueError`` naming the class
    for a class not served or sizes its patching cannot take."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    name, spec = _spec(model)
    config = getattr(model, "config", None)
    if not isinstance(config, Mapping):
        raise ValueError(f"{type(model).__name__}: no diffusers config on the model (model.config); pass the "
                         f"diffusers model itself, not a wrapper around it")
    draw = _Draw(model=model, name=name, batch=batch, generator=generator,
                 device=torch.device(device) if device is not None else _device(model),
                 dtype=dtype or _floating_dtype(model), latent=latent_size or DEFAULT_LATENT,
                 frames=frames or DEFAULT_FRAMES, text=text_tokens or DEFAULT_TEXT)
    kwargs = spec.build(draw, config)
    if "return_dict" in _forward_parameters(model):
        kwargs.setdefault("return_dict", False)
    return kwargs, draw.target()


def _forward_parameters(model: nn.Module) -> Mapping[str, Any]:
    import inspect

    return inspect.signature(model.forward).parameters


def flow_matching_loss(model: nn.Module, inputs: Mapping[str, Any], target: torch.Tensor) -> torch.Tensor:
    """Run ``model(**inputs)`` and return the mean squared error (float32) between its
    prediction and ``target`` (both from `denoiser_inputs`). The prediction is taken from
    the tuple or output object the forward returns and brought into the target's layout
    the way the class's pipeline reads it (first half of a learned-variance output,
    negated for classes predicting ``x0 - noise``, streams joined)."""
    return prediction_loss(model, model(**inputs), target)


def prediction_loss(model: nn.Module, output: Any, target: torch.Tensor) -> torch.Tensor:
    """The flow-matching loss of ``output``, what ``model``'s forward returned for the
    inputs `denoiser_inputs` gave with ``target`` (for a caller that runs the forward
    itself: annot's memory trace)."""
    _, spec = _spec(model)
    prediction = spec.predict(output, target)
    if prediction.shape != target.shape:
        raise ValueError(f"{type(model).__name__}: prediction of shape {tuple(prediction.shape)} does not match "
                         f"the target's {tuple(target.shape)}")
    return torch.nn.functional.mse_loss(prediction.float(), target.float())


# --------------------------------------------------------------------------------------
# Flux and its descendants: 2x2 latent patches packed into a token sequence by the
# pipeline (the model's patch_size is 1), rotary ids per token.


def _packed(d: _Draw, channels: int) -> tuple[torch.Tensor, int, int]:
    """``x_t`` packed as the Flux pipelines pack it: ``(B, (H/2) * (W/2), channels)``,
    ``channels`` being 4x the latent channels; and the token grid."""
    side = d.divisible(d.latent, 2, "latent_size")
    return d.noisy(d.batch, side * side, channels), side, side


def _flux_ids(d: _Draw, h: int, w: int, axes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Image ids ``(h * w, axes)`` with (row, col) on axes 1 and 2, text ids all zero
    (pipelines/flux/pipeline_flux.py, ``_prepare_latent_image_ids``)."""
    img = torch.zeros(h * w, axes, device=d.device)
    img[:, 1:3] = d.grid(h, w)
    return img, torch.zeros(d.text, axes, device=d.device)


@_serves("FluxTransformer2DModel")
def _flux(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, txt_ids = _flux_ids(d, h, w)
    kw = dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
              pooled_projections=d.normal(d.batch, c["pooled_projection_dim"]),
              # pipelines/flux/pipeline_flux.py passes timestep / 1000 (t in [0, 1]); the
              # model scales by 1000 itself. Guidance is the guidance scale (default 3.5).
              timestep=d.time(), img_ids=img_ids, txt_ids=txt_ids)
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(3.5)
    return kw


def _diagonal_text_ids(d: _Draw, modality: float = 0.0) -> torch.Tensor:
    """Text ids ``(modality, i, i)``: text advancing along both spatial rotary axes."""
    positions = d.arange(d.text)
    return torch.stack([torch.full_like(positions, modality), positions, positions], dim=1)


@_serves("ChromaTransformer2DModel")
def _chroma(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, txt_ids = _flux_ids(d, h, w)
    # pipelines/chroma/pipeline_chroma.py: Flux's ids, timestep / 1000.
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                timestep=d.time(), img_ids=img_ids, txt_ids=txt_ids)


@_serves("OvisImageTransformer2DModel")
def _ovis(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, _ = _flux_ids(d, h, w)
    # pipelines/ovis_image/pipeline_ovis_image.py: Flux's image ids, text ids (0, i, i),
    # timestep / 1000.
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                timestep=d.time(), img_ids=img_ids, txt_ids=_diagonal_text_ids(d))


@_serves("LongCatImageTransformer2DModel")
def _longcat_image(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, _ = _flux_ids(d, h, w)
    # pipelines/longcat_image/pipeline_longcat_image.py (prepare_pos_ids): text (0, i, i),
    # the image (1, row, col) past the text's positions; timestep / 1000; its guidance is
    # unused by the forward.
    img_ids[:, 0] = 1
    img_ids[:, 1:] += d.text
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                timestep=d.time(), img_ids=img_ids, txt_ids=_diagonal_text_ids(d))


@_serves("BriaTransformer2DModel")
def _bria(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, txt_ids = _flux_ids(d, h, w)
    if c["guidance_embeds"]:
        # Its forward tests `if guidance:` on the tensor: one value only, a batch of more
        # raises; the Bria pipeline never passes guidance.
        raise d.refuse("guidance_embeds=True: the forward reads the guidance tensor as a bool")
    # pipelines/bria/pipeline_bria.py passes the scheduler's timestep (t * 1000) unscaled.
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                timestep=d.time(1000.0), img_ids=img_ids, txt_ids=txt_ids)


@_serves("BriaFiboTransformer2DModel")
def _bria_fibo(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    img_ids, txt_ids = _flux_ids(d, h, w)
    # pipelines/bria_fibo/pipeline_bria_fibo.py: the scheduler's timestep (t * 1000) and one
    # text-encoder layer per block (joint then single).
    layers = c["num_layers"] + c["num_single_layers"]
    kw = dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
              text_encoder_layers=[d.texts(c["text_encoder_dim"]) for _ in range(layers)],
              timestep=d.time(1000.0), img_ids=img_ids, txt_ids=txt_ids)
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(3.5)
    return kw


def _four_axis_ids(d: _Draw, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux 2's and 3's rotary ids (t, h, w, l): the image on its (h, w) grid at l = 0, the
    text along l."""
    img_ids = torch.zeros(h * w, 4, device=d.device)
    img_ids[:, 1:3] = d.grid(h, w)
    txt_ids = torch.zeros(d.text, 4, device=d.device)
    txt_ids[:, 3] = d.arange(d.text)
    return img_ids, txt_ids


@_serves("Flux2Transformer2DModel")
def _flux2(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    # pipelines/flux2/pipeline_flux2.py: 4-axis ids (t, h, w, l), text advancing along l;
    # timestep / 1000; guidance = guidance scale (default 4.0) where the model embeds it.
    img_ids, txt_ids = _four_axis_ids(d, h, w)
    kw = dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
              timestep=d.time(), img_ids=img_ids, txt_ids=txt_ids)
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(4.0)
    return kw


@_serves("Flux3Transformer2DModel")
def _flux3(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    # modular_pipelines/flux3/before_denoise.py: ids (t, h, w, l), image l = 0, text along
    # l; modular_pipelines/flux3/denoise.py passes t / 1000, and to a flow-map model the
    # timestep it jumps to (here 0: the whole way to the data).
    img_ids, txt_ids = _four_axis_ids(d, h, w)
    kw = dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
              timestep=d.time(), img_ids=img_ids, txt_ids=txt_ids)
    if c["flow_map"]:
        kw["target_timestep"] = d.full(0.0)
    return kw


# --------------------------------------------------------------------------------------
# Image models on (B, C, H, W) latents.


def _image(d: _Draw, c: Config, channels: str = "in_channels", patch: int | None = None) -> torch.Tensor:
    p = patch if patch is not None else (c.get("patch_size") or 1)
    d.divisible(d.latent, p, "latent_size")
    return d.noisy(d.batch, c[channels], d.latent, d.latent)


@_serves("SD3Transformer2DModel")
def _sd3(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py passes the scheduler's
    # timestep: t * 1000.
    return dict(hidden_states=_image(d, c), encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                pooled_projections=d.normal(d.batch, c["pooled_projection_dim"]), timestep=d.time(1000.0))


@_serves("AuraFlowTransformer2DModel")
def _auraflow(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/aura_flow/pipeline_aura_flow.py: "timestep value between 0 and 1" (t / 1000).
    return dict(hidden_states=_image(d, c), encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                timestep=d.time())


def _sizes(d: _Draw) -> torch.Tensor:
    """Pixel sizes ``(B, 2)`` of an 8x-downsampling VAE's image (the size conditioning)."""
    return torch.full((d.batch, 2), 8.0 * d.latent, device=d.device)


@_serves("CogView3PlusTransformer2DModel", "CogView4Transformer2DModel")
def _cogview(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/cogview3/pipeline_cogview3plus.py and pipelines/cogview4/pipeline_cogview4.py
    # pass the scheduler's timestep (t * 1000) and the size conditions in pixels.
    return dict(hidden_states=_image(d, c), encoder_hidden_states=d.texts(c["text_embed_dim"]),
                timestep=d.time(1000.0), original_size=_sizes(d), target_size=_sizes(d),
                crop_coords=torch.zeros(d.batch, 2, device=d.device))


@_serves("GlmImageTransformer2DModel")
def _glm_image(d: _Draw, c: Config) -> dict[str, Any]:
    x = _image(d, c)
    tokens = (d.latent // c["patch_size"]) ** 2
    # pipelines/glm_image/pipeline_glm_image.py: timestep = scheduler timestep - 1, the
    # autoregressive prior's token per latent patch, none dropped.
    prior = d.integers(c["prior_vq_quantizer_codebook_size"], d.batch, tokens)
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["text_embed_dim"]),
                prior_token_id=prior,
                prior_token_drop=torch.zeros(d.batch, tokens, dtype=torch.bool, device=d.device),
                timestep=d.time(1000.0) - 1, target_size=_sizes(d),
                crop_coords=torch.zeros(d.batch, 2, device=d.device))


@_serves("ErnieImageTransformer2DModel")
def _ernie(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/ernie_image/pipeline_ernie_image.py: the scheduler's timestep (t * 1000),
    # text padded to one length with its true lengths beside it.
    return dict(hidden_states=_image(d, c), timestep=d.time(1000.0), text_bth=d.texts(c["text_in_dim"]),
                text_lens=torch.full((d.batch,), d.text, dtype=torch.long, device=d.device))


@_serves("DiTTransformer2DModel", predict=_learned_sigma)
def _dit(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/dit/pipeline_dit.py: the scheduler's timestep (t * 1000) and an ImageNet
    # class label per sample.
    return dict(hidden_states=_image(d, c), timestep=d.time(1000.0),
                class_labels=d.integers(c["num_embeds_ada_norm"], d.batch))


@_serves("PixArtTransformer2DModel", predict=_learned_sigma)
def _pixart(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/pixart_alpha/pipeline_pixart_sigma.py: the scheduler's timestep (t * 1000);
    # pipelines/pixart_alpha/pipeline_pixart_alpha.py: the resolution and aspect-ratio
    # conditions where the model takes them (its use_additional_conditions, which its
    # __init__ derives from the config).
    kw: dict[str, Any] = dict(hidden_states=_image(d, c), encoder_hidden_states=d.texts(c["caption_channels"]),
                              timestep=d.time(1000.0),
                              added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    if getattr(d.model, "use_additional_conditions", False):
        kw["added_cond_kwargs"] = {"resolution": _sizes(d), "aspect_ratio": d.full(1.0)[:, None]}
    return kw


@_serves("Transformer2DModel", "DreamLiteTransformer2DModel", predict=_learned_sigma)
def _transformer_2d(d: _Draw, c: Config) -> dict[str, Any]:
    # The spatial transformer of UNets (continuous input: residual on (B, C, H, W)), or
    # PixArt/DiT's own layout when patched; its pipelines pass the scheduler's timestep.
    kw: dict[str, Any] = dict(hidden_states=_image(d, c, patch=c.get("patch_size") or 1),
                              timestep=d.time(1000.0))
    if c.get("cross_attention_dim"):
        kw["encoder_hidden_states"] = d.texts(c["cross_attention_dim"])
    if c.get("num_embeds_ada_norm") and c.get("norm_type") in ("ada_norm_zero", "ada_norm_continuous"):
        kw["class_labels"] = d.integers(c["num_embeds_ada_norm"], d.batch)
    if c.get("norm_type") == "ada_norm_single":
        kw["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
    return kw


@_serves("TransformerTemporalModel")
def _temporal(d: _Draw, c: Config) -> dict[str, Any]:
    # The temporal layer of AnimateDiff-style UNets: each sample's frames folded into the
    # batch, (B * F, C, H, W), unfolded by num_frames; it returns the input's shape. Every
    # frame of a sample shares its t.
    d.t = d.t.repeat_interleave(d.frames)
    d.batch *= d.frames
    return dict(hidden_states=d.noisy(d.batch, c["in_channels"], d.latent, d.latent), num_frames=d.frames)


# --------------------------------------------------------------------------------------
# Video models on (B, C, F, H, W) latents.


def _video(d: _Draw, channels: int, p_t: int = 1, p: int = 1, *, frames_first: bool = False) -> torch.Tensor:
    """``x_t`` of a video latent, ``(B, C, F, H, W)`` or ``(B, F, C, H, W)``."""
    d.divisible(d.frames, p_t, "frames")
    d.divisible(d.latent, p, "latent_size")
    if frames_first:
        return d.noisy(d.batch, d.frames, channels, d.latent, d.latent)
    return d.noisy(d.batch, channels, d.frames, d.latent, d.latent)


def _with_condition(d: _Draw, x: torch.Tensor, channels: int, dim: int = 1) -> torch.Tensor:
    """``x`` padded with zero channels up to ``channels``: the conditioning latents and
    mask an image- or video-conditioned pipeline concatenates, empty (text-only: the
    pipelines pass zeros there, e.g. pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py)."""
    extra = channels - x.shape[dim]
    if extra < 0:
        raise d.refuse(f"in_channels {channels} is less than the latent channels {x.shape[dim]}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim=dim)


def _patch3(c: Config) -> tuple[int, int, int]:
    p = c["patch_size"]
    return (p[0], p[1], p[2]) if isinstance(p, (tuple, list)) else (1, p, p)


@_serves("WanTransformer3DModel", "ChronoEditTransformer3DModel", "SkyReelsV2Transformer3DModel",
         "HeliosTransformer3DModel")
def _wan(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = _patch3(c)
    # pipelines/wan/pipeline_wan.py (and chronoedit, skyreels_v2, helios): the scheduler's
    # timestep, t * 1000. Image-to-video checkpoints (image_dim set) add CLIP image tokens
    # and condition channels.
    x = _video(d, c["out_channels"], p_t, p_h)
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"]), timestep=d.time(1000.0),
                              encoder_hidden_states=d.texts(c["text_dim"]))
    if c.get("image_dim"):
        kw["encoder_hidden_states_image"] = d.texts(c["image_dim"], 4)
    return kw


@_serves("WanVACETransformer3DModel")
def _wan_vace(d: _Draw, c: Config) -> dict[str, Any]:
    kw = _wan(d, c)
    # pipelines/wan/pipeline_wan_vace.py: control video latents (reference and mask
    # channels, vace_in_channels) at the latent's size, one scale per VACE layer.
    kw["control_hidden_states"] = d.normal(d.batch, c["vace_in_channels"], d.frames, d.latent, d.latent)
    kw["control_hidden_states_scale"] = torch.ones(len(c["vace_layers"]), device=d.device)
    return kw


@_serves("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel")
def _cogvideox(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/cogvideo/pipeline_cogvideox.py: (B, F, C, H, W), the scheduler's timestep
    # (t * 1000). Image-to-video checkpoints take the image latents as extra channels.
    x = _video(d, c["out_channels"], c.get("patch_size_t") or 1, c["patch_size"], frames_first=True)
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"], dim=2),
                              encoder_hidden_states=d.texts(c["text_embed_dim"], c["max_text_seq_length"]),
                              timestep=d.time(1000.0))
    if c.get("ofs_embed_dim"):
        kw["ofs"] = d.full(2.0)  # CogVideoX 1.5 image-to-video: the pipeline's fixed ofs
    return kw


@_serves("AllegroTransformer3DModel")
def _allegro(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/allegro/pipeline_allegro.py: the scheduler's timestep (t * 1000).
    return dict(hidden_states=_video(d, c["in_channels"], c["patch_size_t"], c["patch_size"]),
                encoder_hidden_states=d.texts(c["caption_channels"]), timestep=d.time(1000.0))


@_serves("LatteTransformer3DModel", predict=_learned_sigma)
def _latte(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/latte/pipeline_latte.py: the scheduler's timestep (t * 1000); the pipeline
    # keeps the first half of a learned-variance output.
    return dict(hidden_states=_video(d, c["in_channels"], 1, c["patch_size"]),
                encoder_hidden_states=d.texts(c["caption_channels"]), timestep=d.time(1000.0))


@_serves("EasyAnimateTransformer3DModel", predict=_learned_sigma)
def _easyanimate(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/easyanimate/pipeline_easyanimate.py: the scheduler's timestep (t * 1000).
    kw: dict[str, Any] = dict(hidden_states=_video(d, c["in_channels"], 1, c["patch_size"]),
                              timestep=d.time(1000.0), encoder_hidden_states=d.texts(c["text_embed_dim"]))
    if c.get("text_embed_dim_t5"):
        kw["encoder_hidden_states_t5"] = d.texts(c["text_embed_dim_t5"])
    return kw


@_serves("MochiTransformer3DModel", predict=_negated)
def _mochi(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/mochi/pipeline_mochi.py runs a scheduler with invert_sigmas=True
    # (schedulers/scheduling_flow_match_euler_discrete.py): the model's time is
    # (1 - t) * 1000 and it predicts x0 - noise.
    return dict(hidden_states=_video(d, c["in_channels"], 1, c["patch_size"]),
                encoder_hidden_states=d.texts(c["text_embed_dim"]), timestep=d.time(1000.0, reverse=True),
                encoder_attention_mask=d.ones(d.batch, d.text))


@_serves("HunyuanVideoTransformer3DModel")
def _hunyuan_video(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/hunyuan_video/pipeline_hunyuan_video.py: the scheduler's timestep
    # (t * 1000), guidance = guidance scale * 1000 (default 6.0).
    x = _video(d, c["out_channels"], c["patch_size_t"], c["patch_size"])
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"]), timestep=d.time(1000.0),
                              encoder_hidden_states=d.texts(c["text_embed_dim"]),
                              encoder_attention_mask=d.ones(d.batch, d.text),
                              pooled_projections=d.normal(d.batch, c["pooled_projection_dim"]))
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(6000.0)
    return kw


@_serves("HunyuanVideoFramepackTransformer3DModel")
def _framepack(d: _Draw, c: Config) -> dict[str, Any]:
    kw = _hunyuan_video(d, c)
    # pipelines/hunyuan_video/pipeline_hunyuan_video_framepack.py: SigLIP image tokens,
    # the index of each latent frame, and the packed history the forward always reads:
    # clean latents (the first frame and the last generated one), and 2x and 4x
    # downsampled history frames, each with frame indices before the generated ones.
    channels = c["out_channels"]
    history = {"latents_clean": 2, "latents_history_2x": 2, "latents_history_4x": 4}
    start = 0
    for name, count in history.items():
        kw[name] = d.normal(d.batch, channels, count, d.latent, d.latent)
        kw["indices_" + name] = d.arange(count, torch.long) + start
        start += count
    kw["image_embeds"] = d.texts(c["image_proj_dim"], 4)
    kw["indices_latents"] = d.arange(d.frames, torch.long) + start
    return kw


@_serves("HunyuanVideo15Transformer3DModel")
def _hunyuan_video15(d: _Draw, c: Config) -> dict[str, Any]:
    x = _video(d, c["out_channels"], c["patch_size_t"], c["patch_size"])
    # pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py: the scheduler's timestep
    # (t * 1000) in the latents' dtype; text-to-video passes zero condition latents and
    # mask and zero image embeddings; a second (ByT5) text stream with its mask.
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"]),
                              timestep=d.time(1000.0, cast=True), encoder_hidden_states=d.texts(c["text_embed_dim"]),
                              encoder_attention_mask=d.ones(d.batch, d.text),
                              encoder_hidden_states_2=d.texts(c["text_embed_2_dim"]),
                              encoder_attention_mask_2=d.ones(d.batch, d.text),
                              image_embeds=d.zeros(d.batch, 4, c["image_embed_dim"]))
    if c["use_meanflow"]:
        kw["timestep_r"] = d.time(1000.0, cast=True)
    return kw


@_serves("HunyuanImageTransformer2DModel")
def _hunyuan_image(d: _Draw, c: Config) -> dict[str, Any]:
    d.divisible(d.latent, c["patch_size"][0], "latent_size")
    x = d.noisy(d.batch, c["out_channels"], d.latent, d.latent)
    # pipelines/hunyuan_image/pipeline_hunyuanimage.py: the scheduler's timestep (t * 1000)
    # in the latents' dtype, guidance = distilled guidance scale * 1000 (3.25 by default),
    # a meanflow model's timestep_r = the next step's (here t: one step of zero length).
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"]), timestep=d.time(1000.0, cast=True),
                              encoder_hidden_states=d.texts(c["text_embed_dim"]),
                              encoder_attention_mask=d.ones(d.batch, d.text))
    if c.get("text_embed_2_dim"):
        kw["encoder_hidden_states_2"] = d.texts(c["text_embed_2_dim"])
        kw["encoder_attention_mask_2"] = d.ones(d.batch, d.text)
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(3250.0, d.dtype)
    if c["use_meanflow"]:
        kw["timestep_r"] = d.time(1000.0, cast=True)
    return kw


@_serves("MotifVideoTransformer3DModel")
def _motif(d: _Draw, c: Config) -> dict[str, Any]:
    x = _video(d, c["out_channels"], c["patch_size_t"], c["patch_size"])
    # pipelines/motif_video/pipeline_motif_video.py: the scheduler's timestep (t * 1000);
    # condition latents and mask channels zero for text-to-video.
    kw: dict[str, Any] = dict(hidden_states=_with_condition(d, x, c["in_channels"]), timestep=d.time(1000.0),
                              encoder_hidden_states=d.texts(c["text_embed_dim"]),
                              encoder_attention_mask=d.ones(d.batch, d.text))
    if c.get("image_embed_dim"):
        kw["image_embeds"] = d.texts(c["image_embed_dim"], 4)
    return kw


@_serves("LTXVideoTransformer3DModel")
def _ltx(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p = c["patch_size_t"], c["patch_size"]
    f, h, w = d.divisible(d.frames, p_t, "frames"), d.divisible(d.latent, p, "latent_size"), d.latent // p
    # pipelines/ltx/pipeline_ltx.py: latents packed to (B, F * H * W, C * p_t * p * p), the
    # scheduler's timestep (t * 1000), the token grid for the rotary embedding.
    return dict(hidden_states=d.noisy(d.batch, f * h * w, c["in_channels"]),
                encoder_hidden_states=d.texts(c["caption_channels"]),
                encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long),
                timestep=d.time(1000.0), num_frames=f, height=h, width=w)


@_serves("LTX2VideoTransformer3DModel", predict=_streams)
def _ltx2(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p = c["patch_size_t"], c["patch_size"]
    f, h, w = d.divisible(d.frames, p_t, "frames"), d.divisible(d.latent, p, "latent_size"), d.latent // p
    audio_frames = 4 * d.frames
    # pipelines/ltx2/pipeline_ltx2.py: packed video and audio latents, the scheduler's
    # timestep (t * 1000) for both, and as sigma (LTX-2.3's prompt modulation).
    return dict(hidden_states=d.noisy(d.batch, f * h * w, c["in_channels"]),
                audio_hidden_states=d.noisy(d.batch, audio_frames, c["audio_in_channels"]),
                encoder_hidden_states=d.texts(c["caption_channels"]),
                audio_encoder_hidden_states=d.texts(c["caption_channels"]),
                encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long),
                audio_encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long),
                timestep=d.time(1000.0), sigma=d.time(1000.0),
                num_frames=f, height=h, width=w, audio_num_frames=audio_frames)


@_serves("CosmosTransformer3DModel")
def _cosmos(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = _patch3(c)
    x = _video(d, c["out_channels"], p_t, p_h)
    # pipelines/cosmos/pipeline_cosmos2_5_predict.py (flow matching): timestep = sigma (t);
    # a condition mask channel where the model takes one (zero: nothing given), the
    # padding mask at pixel size (none padded).
    kw: dict[str, Any] = dict(hidden_states=x, timestep=d.time(), encoder_hidden_states=d.texts(c["text_embed_dim"]))
    if c["in_channels"] > c["out_channels"]:
        kw["condition_mask"] = d.zeros(d.batch, c["in_channels"] - c["out_channels"], d.frames, d.latent, d.latent)
    if c["concat_padding_mask"]:
        kw["padding_mask"] = d.zeros(1, 1, 8 * d.latent, 8 * d.latent)
    return kw


@_serves("SanaTransformer2DModel", predict=_learned_sigma)
def _sana(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/sana/pipeline_sana.py: the scheduler's timestep (t * 1000) times the
    # model's timestep_scale; guidance-embedding (Sprint) models take the guidance scale.
    kw: dict[str, Any] = dict(hidden_states=_image(d, c), encoder_hidden_states=d.texts(c["caption_channels"]),
                              encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long),
                              timestep=d.time(1000.0 * c["timestep_scale"]))
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(4.5)
    return kw


@_serves("SanaVideoTransformer3DModel", predict=_learned_sigma)
def _sana_video(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = _patch3(c)
    # pipelines/sana_video/pipeline_sana_video.py: the scheduler's timestep (t * 1000).
    kw: dict[str, Any] = dict(hidden_states=_video(d, c["in_channels"], p_t, p_h),
                              encoder_hidden_states=d.texts(c["caption_channels"]),
                              encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long),
                              timestep=d.time(1000.0))
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(4.5)
    return kw


@_serves("Kandinsky5Transformer3DModel")
def _kandinsky5(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, p_w = c["patch_size"]
    d.divisible(d.frames, p_t, "frames")
    d.divisible(d.latent, p_h, "latent_size")
    # pipelines/kandinsky5/pipeline_kandinsky.py: channels-last (B, F, H, W, C) latents,
    # with zero condition latents and mask where visual_cond; the scheduler's timestep
    # (t * 1000); rotary positions per axis of the patched grid and of the text.
    x = d.noisy(d.batch, d.frames, d.latent, d.latent, c["out_visual_dim"])
    rope = [d.arange(d.frames // p_t, torch.long), d.arange(d.latent // p_h, torch.long),
            d.arange(d.latent // p_w, torch.long)]
    return dict(hidden_states=_with_condition(d, x, c["in_visual_dim"] * (2 if c["visual_cond"] else 1)
                                              + (1 if c["visual_cond"] else 0), dim=-1),
                encoder_hidden_states=d.texts(c["in_text_dim"]),
                pooled_projections=d.normal(d.batch, c["in_text_dim2"]), timestep=d.time(1000.0),
                visual_rope_pos=rope, text_rope_pos=d.arange(d.text, torch.long))


@_serves("Kandinsky6Transformer3DModel", predict=_streams)
def _kandinsky6(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = c["patch_size"]
    d.divisible(d.frames, p_t, "frames")
    d.divisible(d.latent, p_h, "latent_size")
    # pipelines/kandinsky6/pipeline_kandinsky6_ti2va.py: channels-last video latents (zero
    # condition latents and mask where visual_cond), audio latents, the scheduler's
    # timestep (t * 1000) shared by both.
    x = d.noisy(d.batch, d.frames, d.latent, d.latent, c["out_visual_dim"])
    audio = d.noisy(d.batch, 4 * d.frames, c["in_audio_dim"])
    channels = c["in_visual_dim"] * 2 + 1 if c["visual_cond"] else c["in_visual_dim"]
    return dict(hidden_states=_with_condition(d, x, channels, dim=-1), audio_hidden_states=audio,
                encoder_hidden_states=d.texts(c["in_text_dim"]),
                pooled_projections=d.normal(d.batch, c["in_text_dim2"]), timestep=d.time(1000.0))


# --------------------------------------------------------------------------------------
# Image models with their own conditioning.


def _hidream_predict(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Negated (pipelines/hidream_image/pipeline_hidream_image.py). In training mode the
    model returns its patches, ``(B, C, H/p * W/p, p * p)`` (``unpatchify(..., is_training)``
    in its module): put them back on the latent grid."""
    pred = -_first(output)
    if pred.shape != target.shape and pred.ndim == 4:
        b, ch, _, pp = pred.shape
        p = round(pp ** 0.5)
        h, w = target.shape[2] // p, target.shape[3] // p
        pred = pred.reshape(b, ch, h, w, p, p).permute(0, 1, 2, 4, 3, 5).reshape(b, ch, h * p, w * p)
    return pred


@_serves("HiDreamImageTransformer2DModel", predict=_hidream_predict)
def _hidream(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/hidream_image/pipeline_hidream_image.py: the scheduler's timestep
    # (t * 1000), the prediction negated; T5 tokens, the Llama layers the model taps
    # (stacked, indexed by llama_layers), the pooled CLIP embedding.
    layers = max(c["llama_layers"]) + 1
    return dict(hidden_states=_image(d, c, patch=c["patch_size"] or 2), timesteps=d.time(1000.0),
                encoder_hidden_states_t5=d.texts(c["caption_channels"][0]),
                encoder_hidden_states_llama3=d.normal(layers, d.batch, d.text, c["caption_channels"][1]),
                pooled_embeds=d.normal(d.batch, c["text_emb_dim"]))


@_serves("HunyuanDiT2DModel", predict=_learned_sigma)
def _hunyuan_dit(d: _Draw, c: Config) -> dict[str, Any]:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    p = c["patch_size"]
    grid = d.divisible(d.latent, p, "latent_size")
    heads_dim = c["hidden_size"] // c["num_attention_heads"]
    # pipelines/hunyuandit/pipeline_hunyuandit.py: the scheduler's timestep (t * 1000) in
    # the latents' dtype, CLIP and T5 tokens at the model's fixed text lengths with their
    # masks, the image size conditions (original, target, crop), style 0, and the 2D
    # rotary embedding the pipeline computes for the token grid.
    rope = get_2d_rotary_pos_embed(heads_dim, ((0, 0), (grid, grid)), (grid, grid), device=d.device)
    return dict(hidden_states=_image(d, c, patch=p), timestep=d.time(1000.0, cast=True),
                encoder_hidden_states=d.texts(c["cross_attention_dim"], c["text_len"]),
                text_embedding_mask=d.ones(d.batch, c["text_len"], dtype=torch.long),
                encoder_hidden_states_t5=d.texts(c["cross_attention_dim_t5"], c["text_len_t5"]),
                text_embedding_mask_t5=d.ones(d.batch, c["text_len_t5"], dtype=torch.long),
                image_meta_size=torch.tensor([[8.0 * d.latent] * 4 + [0.0, 0.0]] * d.batch, device=d.device),
                style=torch.zeros(d.batch, dtype=torch.long, device=d.device), image_rotary_emb=rope)


@_serves("Lumina2Transformer2DModel", predict=_negated)
def _lumina2(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/lumina2/pipeline_lumina2.py: "Lumina uses t=0 as the noise and t=1 as the
    # image": timestep 1 - t, the prediction negated.
    return dict(hidden_states=_image(d, c), timestep=d.time(reverse=True),
                encoder_hidden_states=d.texts(c["cap_feat_dim"]),
                encoder_attention_mask=d.ones(d.batch, d.text))


@_serves("LuminaNextDiT2DModel", predict=_negated_sigma)
def _lumina_next(d: _Draw, c: Config) -> dict[str, Any]:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    # pipelines/lumina/pipeline_lumina.py: timestep 1 - t, the prediction negated (the
    # learned-variance half dropped), and the rotary table the pipeline builds (384 x 384
    # positions, head width).
    heads_dim = c["hidden_size"] // c["num_attention_heads"]
    rope = get_2d_rotary_pos_embed_lumina(heads_dim, 384, 384, linear_factor=1.0, ntk_factor=1.0)
    return dict(hidden_states=_image(d, c), timestep=d.time(reverse=True),
                encoder_hidden_states=d.texts(c["cross_attention_dim"]),
                encoder_mask=d.ones(d.batch, d.text, dtype=torch.long), image_rotary_emb=rope.to(d.device),
                cross_attention_kwargs={})


@_serves("QwenImageTransformer2DModel")
def _qwen_image(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    # pipelines/qwenimage/pipeline_qwenimage.py: 2x2-packed latents, timestep / 1000, the
    # token grid of each sample's image, guidance only for guidance-distilled models.
    kw: dict[str, Any] = dict(hidden_states=x, encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                              encoder_hidden_states_mask=d.ones(d.batch, d.text, dtype=torch.long),
                              timestep=d.time(), img_shapes=[[(1, h, w)]] * d.batch)
    if c["guidance_embeds"]:
        kw["guidance"] = d.full(4.0)
    return kw


@_serves("NucleusMoEImageTransformer2DModel", predict=_negated)
def _nucleus(d: _Draw, c: Config) -> dict[str, Any]:
    p = c["patch_size"]
    side = d.divisible(d.latent, p, "latent_size")
    # pipelines/nucleusmoe_image/pipeline_nucleusmoe_image.py: latents packed in p x p
    # patches, timestep / num_train_timesteps (t), the prediction negated.
    return dict(hidden_states=d.noisy(d.batch, side * side, c["in_channels"]), img_shapes=[(1, side, side)] * d.batch,
                encoder_hidden_states=d.texts(c["joint_attention_dim"]),
                encoder_hidden_states_mask=d.ones(d.batch, d.text, dtype=torch.long), timestep=d.time())


def _z_image_predict(output: Any, target: torch.Tensor) -> torch.Tensor:
    # pipelines/z_image/pipeline_z_image.py stacks the per-sample outputs, drops the frame
    # axis and negates.
    return -torch.stack(list(_first(output)), dim=0).squeeze(2)


@_serves("ZImageTransformer2DModel", predict=_z_image_predict)
def _z_image(d: _Draw, c: Config) -> dict[str, Any]:
    p, fp = c["all_patch_size"][0], c["all_f_patch_size"][0]
    d.divisible(d.latent, p, "latent_size")
    x = d.noisy(d.batch, c["in_channels"], d.latent, d.latent)
    # pipelines/z_image/pipeline_z_image.py: one (C, 1, H, W) latent and one caption per
    # sample as lists, timestep (1000 - t * 1000) / 1000 = 1 - t.
    return dict(x=list(x.unsqueeze(2).unbind(0)), t=d.time(reverse=True),
                cap_feats=list(d.texts(c["cap_feat_dim"]).unbind(0)), patch_size=p, f_patch_size=fp)


@_serves("PRXTransformer2DModel")
def _prx(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/prx/pipeline_prx.py: t / num_train_timesteps (t).
    return dict(hidden_states=_image(d, c), timestep=d.time(), encoder_hidden_states=d.texts(c["context_in_dim"]))


@_serves("OmniGenTransformer2DModel", predict=_negated)
def _omnigen(d: _Draw, c: Config) -> dict[str, Any]:
    p = c["patch_size"]
    x = _image(d, c)
    image_tokens = (d.latent // p) ** 2
    length = d.text + 1 + image_tokens  # text, the time token, the image
    # pipelines/omnigen/processor_omnigen.py: causal attention over the text and the time
    # token, the image sees everything; positions count through. OmniGen's time runs from
    # noise (0) to image (1) and it predicts x0 - noise (the pipeline's sigmas go 1 -> 0
    # through an inverted scheduler), so the timestep is 1 - t and the prediction negated.
    mask = torch.zeros(length, length, device=d.device)
    mask[: d.text + 1, : d.text + 1] = torch.tril(torch.ones(d.text + 1, d.text + 1, device=d.device))
    mask[d.text + 1:] = 1
    return dict(hidden_states=x, timestep=d.time(reverse=True), input_ids=d.integers(c["vocab_size"], d.batch, d.text),
                input_img_latents=[],
                input_image_sizes={}, attention_mask=mask.expand(d.batch, -1, -1),
                position_ids=d.arange(length, torch.long).expand(d.batch, -1))


@_serves("Krea2Transformer2DModel")
def _krea2(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    # pipelines/krea2/pipeline_krea2.py: timestep / num_train_timesteps (t); a stack of
    # tapped text-encoder layers per token; rotary ids for text (zero) then image.
    ids = torch.cat([torch.zeros(d.text, 3, device=d.device),
                     torch.cat([torch.zeros(h * w, 1, device=d.device), d.grid(h, w)], dim=1)])
    return dict(hidden_states=x, encoder_hidden_states=d.normal(d.batch, d.text, c["num_text_layers"],
                                                                c["text_hidden_dim"]),
                timestep=d.time(), position_ids=ids, encoder_attention_mask=d.ones(d.batch, d.text))


def _ideogram4_predict(output: Any, target: torch.Tensor) -> torch.Tensor:
    # pipelines/ideogram4/pipeline_ideogram4.py reads the image positions after the text
    # and steps the scheduler with -v.
    return -_first(output)[:, -target.shape[1]:]


@_serves("Ideogram4Transformer2DModel", predict=_ideogram4_predict)
def _ideogram4(d: _Draw, c: Config) -> dict[str, Any]:
    from diffusers.models.transformers.transformer_ideogram4 import (
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    x, h, w = _packed(d, c["in_channels"])
    # pipelines/ideogram4/pipeline_ideogram4.py: one packed sequence, text slots (zero
    # latents) then image tokens, the text features beside them (zero at the image);
    # time 1 - t (0 is noise) in the model's dtype, one segment per sample.
    length = d.text + h * w
    hidden = torch.cat([torch.zeros(d.batch, d.text, x.shape[2], dtype=x.dtype, device=d.device), x], dim=1)
    text = torch.cat([d.texts(c["llm_features_dim"]), d.zeros(d.batch, h * w, c["llm_features_dim"])], dim=1)
    positions = torch.zeros(length, 3, dtype=torch.long, device=d.device)
    positions[: d.text, :] = d.arange(d.text, torch.long)[:, None]
    positions[d.text:, 1:] = d.grid(h, w, dtype=torch.long)
    indicator = torch.full((d.batch, length), OUTPUT_IMAGE_INDICATOR, dtype=torch.long, device=d.device)
    indicator[:, : d.text] = LLM_TOKEN_INDICATOR
    return dict(hidden_states=hidden, timestep=d.time(reverse=True, cast=True), encoder_hidden_states=text,
                position_ids=positions.expand(d.batch, -1, -1),
                segment_ids=torch.ones(d.batch, length, dtype=torch.long, device=d.device), indicator=indicator)


@_serves("PriorTransformer")
def _prior(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/kandinsky/pipeline_kandinsky_prior.py: the image embedding being denoised,
    # the pooled text embedding, the text tokens at the model's length, the scheduler's
    # timestep (t * 1000).
    width = c["clip_embed_dim"] or c["embedding_dim"]
    kw: dict[str, Any] = dict(hidden_states=d.noisy(d.batch, width), timestep=d.time(1000.0),
                              proj_embedding=d.normal(d.batch, c["embedding_proj_dim"] or c["embedding_dim"]))
    if c["encoder_hid_proj_type"] is not None:
        kw["encoder_hidden_states"] = d.texts(c["embedding_dim"], c["num_embeddings"])
        kw["attention_mask"] = d.ones(d.batch, c["num_embeddings"])
    return kw


@_serves("T5FilmDecoder")
def _t5_film(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/deprecated/spectrogram_diffusion/pipeline_spectrogram_diffusion.py: the
    # encoder outputs and masks of the note and context streams, the noisy spectrogram
    # frames, noise time t / num_train_timesteps (t).
    streams = [(d.texts(c["d_model"]), d.ones(d.batch, d.text)) for _ in range(2)]
    return dict(encodings_and_masks=streams, decoder_input_tokens=d.noisy(d.batch, c["targets_length"],
                                                                          c["input_dims"]),
                decoder_noise_time=d.time())


# --------------------------------------------------------------------------------------
# Audio models: latent_size ** 2 latent frames (as many tokens as an image's latent).


def _frames(d: _Draw) -> int:
    return d.latent * d.latent


@_serves("AceStepTransformer1DModel")
def _ace_step(d: _Draw, c: Config) -> dict[str, Any]:
    length = _frames(d)
    x = d.noisy(d.batch, length, c["audio_acoustic_hidden_dim"])
    # pipelines/ace_step/pipeline_ace_step.py: its scheduler runs with num_train_timesteps=1,
    # so timestep and timestep_r are t itself (equal: no mean-flow jump), in the latents'
    # dtype; the context latents fill the rest of in_channels.
    return dict(hidden_states=x, timestep=d.time(cast=True), timestep_r=d.time(cast=True),
                encoder_hidden_states=d.texts(c["encoder_hidden_size"] or c["hidden_size"]),
                context_latents=d.normal(d.batch, length, c["in_channels"] - c["audio_acoustic_hidden_dim"]))


@_serves("StableAudioDiTModel")
def _stable_audio(d: _Draw, c: Config) -> dict[str, Any]:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    length = _frames(d)
    # pipelines/stable_audio/pipeline_stable_audio.py: the text-and-duration tokens, the
    # duration as the global token, the rotary table over the latent frames and the global
    # token. Its scheduler is EDM's (timestep = preconditioned noise level in [0, 1)); the
    # flow-matching step passes t.
    rope = get_1d_rotary_pos_embed(c["attention_head_dim"] // 2, length + 1, use_real=True,
                                   repeat_interleave_real=False)
    return dict(hidden_states=d.noisy(d.batch, c["in_channels"], length), timestep=d.time(),
                encoder_hidden_states=d.texts(c["cross_attention_input_dim"]),
                global_hidden_states=d.normal(d.batch, 1, c["global_states_input_dim"]),
                rotary_embedding=tuple(r.to(d.device) for r in rope))


@_serves("StableAudio3DiTModel")
def _stable_audio3(d: _Draw, c: Config) -> dict[str, Any]:
    length = _frames(d)
    d.divisible(length, c["patch_size"], "latent frames")
    # pipelines/stable_audio_3/pipeline_stable_audio_3.py: timestep in [0, 1] (t).
    return dict(hidden_states=d.noisy(d.batch, c["io_channels"], length), timestep=d.time(),
                encoder_hidden_states=d.texts(c["cond_token_dim"]),
                global_hidden_states=d.normal(d.batch, c["global_cond_dim"]),
                encoder_attention_mask=d.ones(d.batch, d.text))


@_serves("LongCatAudioDiTTransformer", predict=_negated)
def _longcat_audio(d: _Draw, c: Config) -> dict[str, Any]:
    length = _frames(d)
    # pipelines/longcat_audio_dit/pipeline_longcat_audio_dit.py builds its scheduler with
    # invert_sigmas=True: timestep = 1 - t, the model predicts x0 - noise; text-to-audio
    # passes zero condition latents to a model that takes them.
    kw: dict[str, Any] = dict(hidden_states=d.noisy(d.batch, length, c["latent_dim"]), timestep=d.time(reverse=True),
                              encoder_hidden_states=d.texts(c["dit_text_dim"]),
                              encoder_attention_mask=d.ones(d.batch, d.text), attention_mask=d.ones(d.batch, length))
    if c["use_latent_condition"]:
        kw["latent_cond"] = d.zeros(d.batch, length, c["latent_dim"])
    return kw


@_serves("MiniMaxMusic3Transformer1DModel", predict=_negated)
def _minimax_music3(d: _Draw, c: Config) -> dict[str, Any]:
    length = _frames(d)
    # modular_pipelines/minimax_music3/denoise.py: "flow-matching time in [0, 1], 0 =
    # noise" (1 - t) in the latents' dtype, stepped by an inverted scheduler: the model
    # predicts x0 - noise.
    return dict(hidden_states=d.noisy(d.batch, c["in_channels"], length), timestep=d.time(reverse=True, cast=True),
                encoder_hidden_states=d.normal(d.batch, length, c["condition_dim"]))


@_serves("MiniMaxH3Transformer3DModel", predict=_streams)
def _minimax_h3(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, p_w = c["patch_size"]
    f, h = d.divisible(d.frames, p_t, "frames"), d.divisible(d.latent, p_h, "latent_size")
    w = d.latent // p_w
    # modular_pipelines/minimax_h3: one packed sequence of text, video and audio rows;
    # timestep holds the distinct values (in [0, 1]) and every row indexes one, shared
    # by the whole batch: one t for every sample here.
    d.t = d.t[:1].expand(d.batch).clone()
    audio_rows = 4 * d.frames
    video = d.noisy(d.batch, f * h * w, c["in_channels"] * p_t * p_h * p_w)
    audio = d.noisy(d.batch, audio_rows, c["audio_in_channels"])
    n_video = f * h * w
    length = d.text + n_video + audio_rows
    text_idx = d.arange(d.text, torch.long)
    video_idx = d.arange(n_video, torch.long) + d.text
    audio_idx = d.arange(audio_rows, torch.long) + d.text + n_video
    positions = torch.zeros(length, 3, device=d.device)
    positions[: d.text, 0] = d.arange(d.text)
    positions[d.text: d.text + n_video] = d.grid(f, h, w)
    positions[d.text + n_video:, 0] = d.arange(audio_rows)
    tags = torch.cat([torch.full((d.text,), 1), torch.full((n_video,), 0), torch.full((audio_rows,), 2)])
    return dict(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=d.texts(c["text_dim"]),
                timestep=d.t[:1].clone(), timestep_indices=torch.zeros(length, dtype=torch.long, device=d.device),
                token_tags=tags.to(d.device), position_ids=positions, video_indices=video_idx,
                audio_indices=audio_idx, text_indices=text_idx)


@_serves("AnyFlowTransformer3DModel")
def _anyflow(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = c["patch_size"]
    # pipelines/anyflow/pipeline_anyflow.py: (B, F, C, H, W); the scheduler's timestep
    # (t * 1000) per frame, and r_timestep, the time the flow map jumps to, equal to it
    # when the pipeline has none (an instantaneous velocity).
    x = _video(d, c["in_channels"], p_t, p_h, frames_first=True)
    per_frame = d.time(1000.0)[:, None].expand(-1, d.frames)
    kw: dict[str, Any] = dict(hidden_states=x, timestep=per_frame, r_timestep=per_frame,
                              encoder_hidden_states=d.texts(c["text_dim"]))
    if c.get("image_dim"):
        kw["encoder_hidden_states_image"] = d.texts(c["image_dim"], 4)
    return kw


@_serves("AnyFlowFARTransformer3DModel")
def _anyflow_far(d: _Draw, c: Config) -> dict[str, Any]:
    kw = _anyflow(d, c)
    # pipelines/anyflow/pipeline_anyflow_far.py: the frames split into chunks, one frame
    # each, all full-resolution (at most full_chunk_limit of them).
    if d.frames > c["full_chunk_limit"]:
        raise d.refuse(f"frames {d.frames} exceed full_chunk_limit {c['full_chunk_limit']}: the compressed "
                       f"context chunks need clean frames this builder does not draw")
    kw["chunk_partition"] = [1] * d.frames
    return kw


@_serves("BriaFibo2Transformer2DModel")
def _bria_fibo2(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/bria_fibo2/pipeline_bria_fibo2.py: timestep / 1000 (t; the model scales by
    # t_scale), text as bundles (B, 1 + injections, T, width): the perceiver's input then
    # one bundle per injection layer. No mask: every token valid (the mask's lengths are
    # read as values).
    bundles = 1 + len(c["injection_layer_ids"])
    return dict(hidden_states=_image(d, c), timestep=d.time(),
                encoder_hidden_states=d.normal(d.batch, bundles, d.text, c["cap_feat_dim"]))


@_serves("JoyImageEditTransformer3DModel")
def _joyimage(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = c["patch_size"]
    # pipelines/joyimage/pipeline_joyimage_edit.py: (B, C, F, H, W) (one item: no
    # reference image), the scheduler's timestep (t * 1000).
    return dict(hidden_states=_video(d, c["in_channels"], p_t, p_h), timestep=d.time(1000.0),
                encoder_hidden_states=d.texts(c["text_dim"]))


@_serves("JoyImageEditPlusTransformer3DModel")
def _joyimage_plus(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, p_w = c["patch_size"]
    f, h = d.divisible(d.frames, p_t, "frames"), d.divisible(d.latent, p_h, "latent_size")
    w = d.latent // p_w
    # pipelines/joyimage/pipeline_joyimage_edit_plus.py: latents as patches (B, N, C, pt,
    # ph, pw), each sample's (t, h, w) patch grids, the scheduler's timestep (t * 1000).
    x = d.noisy(d.batch, f * h * w, c["in_channels"], p_t, p_h, p_w)
    return dict(hidden_states=x, timestep=d.time(1000.0), encoder_hidden_states=d.texts(c["text_dim"]),
                encoder_hidden_states_mask=d.ones(d.batch, d.text, dtype=torch.long),
                shape_list=[[(f, h, w)] for _ in range(d.batch)])


@_serves("Kandinsky6SRTransformer3DModel")
def _kandinsky6_sr(d: _Draw, c: Config) -> dict[str, Any]:
    # pipelines/kandinsky6/pipeline_kandinsky6_sr.py: channels-last tiles [latent | anchor
    # latent | anchor mask], the anchors zero (the released checkpoints are anchor-free);
    # the scheduler's timestep (t * 1000). NABLA attention groups 8 x 8 tokens.
    if c["out_visual_dim"] != c["in_visual_dim"]:
        raise d.refuse(f"out_visual_dim {c['out_visual_dim']} is not in_visual_dim {c['in_visual_dim']}: a "
                       f"widened output has no flow-matching target of the latent's shape")
    d.divisible(d.latent, 8 * c["patch_size"][1], "latent_size")
    x = d.noisy(d.batch, d.frames, d.latent, d.latent, c["in_visual_dim"])
    return dict(hidden_states=_with_condition(d, x, 2 * c["in_visual_dim"] + 1, dim=-1), timestep=d.time(1000.0))


@_serves("WanAnimateTransformer3DModel")
def _wan_animate(d: _Draw, c: Config) -> dict[str, Any]:
    if d.frames < 2:
        raise d.refuse("needs at least 2 latent frames: the pose latents cover all but the first")
    kw = _wan(d, c)
    size = c["motion_encoder_size"]
    latent = c["latent_channels"] or (c["in_channels"] - 4) // 2
    # pipelines/wan/pipeline_wan_animate.py: the reference latents and mask fill
    # in_channels, the pose video's latents cover frames 1.., the face crops run at pixel
    # rate (4 frames per latent frame after the first), size motion_encoder_size.
    kw["pose_hidden_states"] = d.normal(d.batch, latent, d.frames - 1, d.latent, d.latent)
    kw["face_pixel_values"] = d.normal(d.batch, 3, 4 * (d.frames - 1), size, size)
    return kw


def _one_of_list(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The first sample's prediction of a list-of-samples output, with its batch axis."""
    pred = _first(output)
    pred = pred[0] if isinstance(pred, (list, tuple)) else pred
    return pred.unsqueeze(0) if pred.ndim == target.ndim - 1 else pred


@_serves("Cosmos3OmniTransformer", predict=_one_of_list)
def _cosmos3_omni(d: _Draw, c: Config) -> dict[str, Any]:
    if d.batch != 1:
        raise d.refuse(f"packs one sample per forward (no batch axis: the pipeline loops over prompts); "
                       f"pass batch=1, not {d.batch}")
    p = c["latent_patch_size"]
    h = d.divisible(d.latent, p, "latent_size")
    tokens = d.frames * h * h
    # pipelines/cosmos/pipeline_cosmos3_omni.py: one packed sequence, the prompt's tokens
    # ("und" part) then the video's patches; the scheduler's timestep (t * 1000, which the
    # model scales by timestep_scale) per noisy token; 3-axis mRoPE ids: text along all
    # three axes, the video (frame after a margin, row, column) without fps modulation.
    x = d.noisy(1, c["latent_channel"], d.frames, d.latent, d.latent)
    text_ids = d.arange(d.text)[None].expand(3, -1)
    start = d.text + c["unified_3d_mrope_temporal_modality_margin"]
    grid = d.grid(d.frames, h, h).T.clone()
    grid[0] += start
    dtype = torch.float32 if c["enable_fps_modulation"] else torch.long
    positions = torch.cat([text_ids, grid], dim=1).to(dtype)
    vision = d.arange(tokens, torch.long) + d.text
    return dict(input_ids=d.integers(c["vocab_size"], d.text), text_indexes=d.arange(d.text, torch.long), position_ids=positions,
                und_len=d.text, sequence_length=d.text + tokens, vision_tokens=[x],
                vision_token_shapes=[(d.frames, h, h)], vision_sequence_indexes=vision,
                vision_mse_loss_indexes=vision, vision_timesteps=d.time(1000.0).expand(tokens),
                vision_noisy_frame_indexes=[d.arange(d.frames, torch.long)])


def _last_tokens(output: Any, target: torch.Tensor) -> torch.Tensor:
    # pipelines/qwenimage21/pipeline_qwenimage21.py keeps the last latents.size(1) tokens.
    return _first(output)[:, -target.shape[1]:]


@_serves("QwenImage21Transformer2DModel", predict=_last_tokens)
def _qwen_image21(d: _Draw, c: Config) -> dict[str, Any]:
    x, h, w = _packed(d, c["in_channels"])
    if (h * w) % 4:
        raise d.refuse(f"{h * w} target tokens: each image slot of the text encoder stands for 4")
    # pipelines/qwenimage21/pipeline_qwenimage21.py: the text encoder's sequence with the
    # target image's slots appended (one per 2x2 group of latent tokens, img_mask True
    # there), the target's token grid last in img_shapes, timestep / 1000 (t).
    mask = torch.cat([torch.zeros(d.batch, d.text, dtype=torch.bool, device=d.device),
                      d.ones(d.batch, h * w // 4)], dim=1)
    return dict(hidden_states=x, encoder_hidden_states=d.texts(c["context_in_dim"]), timestep=d.time(),
                img_shapes=[[(1, h, w)]] * d.batch, img_mask=mask,
                encoder_hidden_states_mask=d.ones(d.batch, d.text))


def _rfd4_predict(output: Any, target: torch.Tensor) -> torch.Tensor:
    # pipelines/rfd4_proteina/pipeline_rfd4_proteina.py: clean = x + (1 - time) * velocity,
    # so the velocities are x0 - noise; backbone and local latents, joined as the target.
    return -torch.cat([output.backbone.flatten(1), output.local_latents.flatten(1)], dim=1)


@_serves("RFD4ProteinaTransformer", predict=_rfd4_predict)
def _rfd4(d: _Draw, c: Config) -> dict[str, Any]:
    from diffusers.models.transformers.transformer_rfd4_proteina import CONDITION_KEYS

    n = d.latent * d.latent  # residues
    # pipelines/rfd4_proteina/pipeline_rfd4_proteina.py: C-alpha coordinates and local
    # latents per residue, each with its time running from noise (0) to data (1): 1 - t.
    # Every residue present and generated (no in-context conditioning), protein tokens,
    # one chain (molecule, entity and index group 0). The per-atom interaction
    # annotations its feature factory requires are all zero (none annotated), and so are
    # the bond path lengths; the other features are absent and zero-filled by the factory.
    atoms = {CONDITION_KEYS[name]: torch.zeros(d.batch, n, 37, dtype=torch.long, device=d.device)
             for name in ("hbond", "pistack", "pication", "saltbridge", "hydrophobic", "metal_coord")}
    conditioning = {"is_in_context_conditioning": torch.zeros(d.batch, n, dtype=torch.bool, device=d.device),
                    "supports_local_latent": d.ones(d.batch, n),
                    "token_bond_path_length": torch.zeros(d.batch, n, n, dtype=torch.long, device=d.device),
                    **{key: torch.zeros(d.batch, n, dtype=torch.long, device=d.device)
                       for key in ("molecule_iid", "molecule_entity_id", CONDITION_KEYS["index_group"])},
                    **atoms}
    return dict(bb_ca=d.noisy(d.batch, n, 3), local_latents=d.noisy(d.batch, n, c["latent_dim"]),
                bb_ca_time=d.time(reverse=True), local_latents_time=d.time(reverse=True),
                padding_mask=d.ones(d.batch, n),
                token_type=torch.zeros(d.batch, n, dtype=torch.long, device=d.device),
                atom37_mask=d.ones(d.batch, n, 37), conditioning=conditioning, return_dict=True)


@_serves("SanaWMTransformer3DModel", predict=_negated)
def _sana_wm(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p_h, _ = c["patch_size"]
    # pipelines/sana_wm/pipeline_sana_wm.py: (B, C, F, H, W) latents, the scheduler's
    # timestep (t * 1000) per frame as (B, 1, F), the text mask the cross-attention needs,
    # the pixel size; it steps the scheduler with -prediction.
    x = _video(d, c["in_channels"], p_t, p_h)
    return dict(hidden_states=x, timestep=d.time(1000.0)[:, None, None].expand(-1, 1, d.frames),
                encoder_hidden_states=d.texts(c["caption_channels"]),
                mask=d.ones(d.batch, d.text, dtype=torch.long),
                data_info={"img_hw": torch.tensor([[8.0 * d.latent] * 2], device=d.device)})


@_serves("SanaWMLTX2RefinerTransformer3DModel")
def _sana_wm_refiner(d: _Draw, c: Config) -> dict[str, Any]:
    p_t, p = c["patch_size_t"], c["patch_size"]
    f, h = d.divisible(d.frames, p_t, "frames"), d.divisible(d.latent, p, "latent_size")
    tokens = f * h * h
    # pipelines/sana_wm/refiner.py: one block of packed video tokens (no KV cache: plain
    # self-attention), the timestep per token already scaled (t * timestep_scale_multiplier),
    # the RoPE of the block's absolute frames from the model's own helper (shapes only).
    build_rope: Callable[..., Any] = d.model.build_rotary_emb_for_absolute_positions  # type: ignore[assignment]
    rope = build_rope(batch_size=d.batch, frame_positions=list(range(d.frames)), height=d.latent, width=d.latent,
                      device=d.device, fps=24.0)
    return dict(hidden_states=d.noisy(d.batch, tokens, c["in_channels"]),
                encoder_hidden_states=d.texts(c["caption_channels"]),
                timestep=d.time(float(c["timestep_scale_multiplier"]))[:, None].expand(-1, tokens),
                video_rotary_emb=rope, encoder_attention_mask=d.ones(d.batch, d.text, dtype=torch.long))
