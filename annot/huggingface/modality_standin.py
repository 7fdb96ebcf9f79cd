"""No rank skips a tower: a batch without an image (video, audio) on one rank while
another rank's batch has one.

A vision-language model runs its vision tower only when its batch has pixel values.
Sharded, the tower's parameters are gathered when it runs (FSDP2 and FSDP1 per unit,
ZeRO-3 per module) and its gradients reduced in backward, all collectives every rank
must join in the same order. A rank whose batch has no image skips them: its next
all-gather pairs with another rank's vision block (gloo aborts with "collective
mismatch"; NCCL hangs: transformers#37186, LLaMA-Factory #5616/#5944; docs/design.md,
pitfall 58).

`ModalityStandIns`, a forward pre-hook and a forward hook on the transformers model,
makes every rank run the tower whenever any rank does. Before each forward the ranks
exchange which of their modalities are present (one small collective, only for a model
with a tower and a world of more than one). When some ranks have a modality and others
not, the lowest rank that has it sends its inputs for that modality (the arguments of
the model's ``get_<modality>_features``: pixel values, image grids, ...) to the others,
and each rank without it runs ``get_<modality>_features`` on them: the same tower and
projector, the same collectives, and an output that is added to the step's result with
weight zero (`ZeroContribution`: the forward's values unchanged bit for bit, the
stand-in's gradients exactly zero). Data parallelism averages the ranks' gradients, so
each rank's step is what it would be alone.

The order of the collectives matters too. FSDP gathers the root's parameters before
the forward and the tower's units when they run, so a stand-in run at the start of the
forward meets the tower where the ranks with images run it (after the embeddings, which
the root holds, before the first language layer). DeepSpeed ZeRO-3 gathers every module
in the order it runs, embeddings included: there the ranks with the modality run their
tower at the start of the forward too, and hand its output to the model through
transformers' ``mm_encoder_outputs`` argument. A model without that argument is refused
on ZeRO-3 at the step where the batches differ, before any collective of the tower.

A model whose language model reads images through cross-attention layers that a
text-only batch skips (Mllama) needs more than the tower: `CrossAttentionStandIn` runs
the whole image path on the rank without images and turns each such layer into the
identity at weight zero. Any other model with a tower and no ``get_<modality>_features``
is refused on every engine. The errors say what to do, and every rank raises the same
one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from annot.errors import AnnotError

__all__ = ["MODALITIES", "CrossAttentionStandIn", "ModalityStandIns", "StandInError", "ZeroContribution",
           "install_stand_ins"]

#: Modality -> the transformers method computing its features (whose first argument is
#: the input that says a batch has it: ``pixel_values``, ``pixel_values_videos``,
#: ``input_features``).
MODALITIES = ("image", "video", "audio")


class StandInError(AnnotError, RuntimeError):
    """Some ranks' batches lack a modality others have, and annot cannot make every rank
    run its tower for this model and engine."""


class ZeroContribution(torch.autograd.Function):
    """``x`` unchanged, with ``others`` in its graph at weight zero: backward gives ``x``
    its gradient as it is and every tensor of ``others`` an exact zero gradient (never
    ``0 * inf``), so what produced them runs its backward (collectives included) and
    accumulates nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.shapes))


@dataclasses.dataclass
class _Modality:
    """One modality of a model: its name (``mm_encoder_outputs``' key), its feature
    method, the forward argument that carries it (the method's first), and the
    arguments the method takes by name."""

    name: str
    method: Callable[..., Any]
    trigger: str
    parameters: tuple[str, ...]


class ModalityStandIns:
    """The hooks that make every rank run a tower any rank runs (module docstring).
    ``ordered_gathers``: the engine gathers parameters module by module in the order
    they run (DeepSpeed ZeRO-3), so the ranks with the modality compute it at the start
    of the forward as well."""

    def __init__(self, model: nn.Module, modalities: list[_Modality], ordered_gathers: bool) -> None:
        self.model = model
        self.name = _class_name(model)
        self.modalities = modalities
        self.ordered_gathers = ordered_gathers
        self.forward_parameters = _parameters(model.forward)
        self.takes_encoder_outputs = "mm_encoder_outputs" in self.forward_parameters
        #: The stand-in outputs of this rank's current forward, attached after it.
        self.pending: list[torch.Tensor] = []
        #: How many forwards ran a stand-in on this rank (tests read it).
        self.stand_ins = 0
        #: Stand-in features the model adds to a language layer's input (Granite-4-Vision's
        #: deepstack pairs), by layer: attached there (`_attach_at_layer`).
        self.at_layer: dict[int, list[torch.Tensor]] = {}
        self.layers = _language_layers(model)
        for index, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(functools.partial(self._attach_at_layer, index), with_kwargs=True)

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.pending = []
        self.at_layer = {}
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        bound = self._bound(args, kwargs)
        present = tuple(bound.get(m.trigger) is not None for m in self.modalities)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, present)
        if not self.ordered_gathers and any(len(set(flags)) > 1 for flags in zip(*everyone, strict=True)):
            self._embed_first(bound)
        changed = False
        for index, modality in enumerate(self.modalities):
            has = [flags[index] for flags in everyone]
            if all(has) or not any(has):
                continue
            self._refuse_if_unable(modality, has)
            source = has.index(True)
            payload: list[dict[str, Any]] = [_to_cpu({name: bound[name] for name in modality.parameters
                                                      if bound.get(name) is not None})
                                             if has[dist.get_rank()] else {}]
            dist.broadcast_object_list(payload, src=source)
            if has[dist.get_rank()]:
                if self.ordered_gathers:  # run it here, where every rank runs its stand-in
                    own = {name: bound[name] for name in modality.parameters if bound.get(name) is not None}
                    # Every argument by name from here: the trigger leaves, the rest stay.
                    bound = {k: v for k, v in bound.items() if k != modality.trigger}
                    encoder_outputs = dict(bound.get("mm_encoder_outputs") or {})
                    encoder_outputs[modality.name] = modality.method(**own, return_dict=True)
                    bound["mm_encoder_outputs"] = encoder_outputs
                    changed = True
                continue
            inputs = _to_device(payload[0], _device_of(module))
            output = modality.method(**inputs, return_dict=True)
            injected = _injected(output, len(self.layers))
            for index, consumed in injected:
                self.at_layer.setdefault(index, []).extend(
                    t for t in tree_leaves(consumed) if isinstance(t, torch.Tensor) and t.requires_grad)
            self.pending += [t for t in tree_leaves(_consumed(output, injected=bool(injected)))
                             if isinstance(t, torch.Tensor) and t.requires_grad]
            self.stand_ins += 1
        return ((), bound) if changed else None

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        others, self.pending = self.pending, []
        if not others:
            return None
        attached = False
        for field in ("loss", "logits", "last_hidden_state"):
            value = getattr(output, field, None) if not isinstance(output, dict) else output.get(field)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                output[field] = ZeroContribution.apply(value, *others)
                attached = True
        if not attached:
            raise StandInError(
                f"{self.name}'s output has no loss, logits or last hidden state to carry the "
                "stand-in tower's zero-weighted output: give every rank's batch the same modalities")
        return output

    def _embed_first(self, bound: dict[str, Any]) -> None:
        """Before a stand-in runs a tower, every rank calls the model's input embeddings
        on one token of its ids, outside autograd: the ranks with the modality embed
        their text before their tower, and where the embeddings are a unit called
        outside its forward (ModernVBERT's text embeddings, reached through
        ``get_input_embeddings()``), the engine gathers that unit there (docs/design.md,
        pitfall 61). Gathered first on every rank, it pairs; the stand-in's tower came
        first on the rank without images, and the ranks' all-gathers crossed. Where the
        root holds the embeddings this gathers nothing."""
        embed = getattr(self.model, "get_input_embeddings", None)
        ids = bound.get("input_ids")
        try:
            embeddings = embed() if callable(embed) else None
        except NotImplementedError:  # transformers' default for a model without one
            embeddings = None
        if isinstance(embeddings, nn.Module) and isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            with torch.no_grad():
                embeddings(ids[:, :1])

    def _attach_at_layer(self, index: int, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Attach the stand-in features a rank with images adds to this layer's input to
        this rank's input of it, at weight zero: their gradient (and the tower's backward,
        with its collectives) then comes where the other ranks' does, right after this
        layer's backward. Attached at the output instead, the tower's backward ran after
        every language layer's, while the ranks with images ran it after this one's."""
        others = self.at_layer.pop(index, None)
        if not others:
            return None
        if args and isinstance(args[0], torch.Tensor):
            return (ZeroContribution.apply(args[0], *others), *args[1:]), kwargs
        hidden = kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            return args, {**kwargs, "hidden_states": ZeroContribution.apply(hidden, *others)}
        raise StandInError(f"{self.name}: language layer {index} takes no hidden states to carry the "
                           "stand-in features at weight zero: give every rank's batch the same modalities")

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return _bound(self.forward_parameters, args, kwargs)

    def _refuse_if_unable(self, modality: _Modality, has: list[bool]) -> None:
        if self.ordered_gathers and not self.takes_encoder_outputs:
            missing = [r for r, h in enumerate(has) if not h]
            raise StandInError(
                f"ranks {missing} have no {modality.trigger} in this step while others do: "
                f"{self.name} takes no mm_encoder_outputs, so annot cannot run "
                "its tower at the same point on every rank, and DeepSpeed ZeRO-3 gathers "
                "parameters module by module in the order they run (a rank skipping the tower "
                "hangs the others). Give every rank's batch at least one "
                f"{modality.name} (a blank one with its tokens masked out of the loss), or train "
                "with engine='fsdp2', where annot runs a zero-weighted stand-in.")


def stand_in_for_towers(model: nn.Module, *, ordered_gathers: bool
                        ) -> ModalityStandIns | CrossAttentionStandIn | None:
    """Install the stand-ins (`install_stand_ins`) on the transformers model ``model`` is
    or holds, once (kept in its `annot.module_state.ModuleState`); what was installed,
    or ``None``. `auto_wrap` calls it after the engine wrapped the model, so that the
    hooks run after the engine's own on the same module (ZeRO-3 gathers a module's
    parameters in its pre-forward hook: the stand-in's tower call needs them)."""
    from annot.huggingface.model import pretrained_inside
    from annot.module_state import module_state

    hf_model = pretrained_inside(model)
    if hf_model is None:
        return None
    state = module_state(hf_model)
    if state.stand_ins is None:
        installed = install_stand_ins(hf_model, ordered_gathers=ordered_gathers)
        state.stand_ins = installed if installed is not None else False
    return state.stand_ins or None


def install_stand_ins(model: nn.Module, *, ordered_gathers: bool
                      ) -> ModalityStandIns | CrossAttentionStandIn | None:
    """Hook `ModalityStandIns` onto the transformers model ``model`` when it has a vision
    or audio tower (`annot.policies.roles`); returns them, or ``None`` for a model
    without one. A model without transformers' feature methods whose images reach the
    language model through cross-attention layers gets `CrossAttentionStandIn`; any
    other model with a tower and no feature method, hooks that refuse a step whose ranks
    differ."""
    from annot.policies.roles import TOWERS, module_roles

    host = _feature_host(model)
    # A tower role, a feature method or a media argument each say the model reads media:
    # Fuyu embeds its patches with a Linear of the root and has no vision config, so no
    # tower role; Phi-4-multimodal names its pixels ``image_pixel_values``.
    if not (any(role in TOWERS for role in module_roles(model).values())
            or any(hasattr(host, f"get_{name}_features") for name in MODALITIES)
            or _media_arguments(model)):
        return None
    modalities = []
    for name in MODALITIES:
        method = getattr(host, f"get_{name}_features", None)
        if method is None:
            continue
        # Read from the class's function: FSDP2 registers the method of a unit or the root
        # (`annot.engines.fsdp2.ENTRY_METHODS`) as a wrapper whose signature, bound,
        # lost the first argument (Nemotron-H-Omni's pixel_values).
        function = getattr(type(host), f"get_{name}_features", None)
        parameters = tuple(_parameters(function)[1:]) if callable(function) else ()  # [1:]: self
        if parameters:
            modalities.append(_Modality(name, method, parameters[0], parameters))
    if not modalities:
        layers = _cross_attention_layers(model)
        if layers:
            cross = CrossAttentionStandIn(model, layers)
            model.register_forward_pre_hook(cross.before, with_kwargs=True)
            model.register_forward_hook(cross.after, with_kwargs=True)
            return cross
        model.register_forward_pre_hook(_refusing(model), with_kwargs=True)
        return ModalityStandIns(model, [], ordered_gathers)
    stand_ins = ModalityStandIns(host, modalities, ordered_gathers)
    host.register_forward_pre_hook(stand_ins.before, with_kwargs=True)
    host.register_forward_hook(stand_ins.after, with_kwargs=True)
    return stand_ins


def _feature_host(model: nn.Module) -> nn.Module:
    """The module whose forward computes the features and takes the text: the deepest
    module of ``model`` with a ``get_<modality>_features`` method whose forward takes
    ``input_ids`` or ``inputs_embeds`` (LLaVA's ``model.model``, not the outer class
    that calls it, nor a tower). Its own parameters (LLaVA-OneVision's ``image_newline``)
    are gathered when it is entered (ZeRO-3), so the stand-in runs there."""
    host = model
    for module in model.modules():
        takes = set(_parameters(module.forward))
        if any(hasattr(module, f"get_{name}_features") for name in MODALITIES) and \
                takes & {"input_ids", "inputs_embeds"}:
            host = module
    return host


class CrossAttentionStandIn:
    """The stand-in of a model whose language model reads the images only through
    cross-attention layers that a text-only batch skips (Mllama: the layers
    ``text_config.cross_attention_layers`` names). Running the tower is not enough
    there: the ranks with images also run those layers, so a rank without runs its own
    forward as if it had images (the first image inputs of the lowest rank with them,
    one copy per sample, a cross-attention mask that shows no image to any token) and
    each cross-attention layer's output is replaced by its input with the output at
    weight zero (`ZeroContribution`). Its text stream is then the text-only forward's,
    bit for bit (Mllama computes text rows differently when a batch has images, so
    showing the images with a mask would not do), and the tower, projector and
    cross-attention layers get exact zero gradients, in the order the other ranks run
    them, on every engine."""

    #: The inputs that carry the images (the cross-attention mask is made per rank).
    IMAGE_INPUTS = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        self.name = _class_name(model)
        self.forward_parameters = _parameters(model.forward)
        self.active = False
        self.stand_ins = 0
        for layer in layers:
            layer.register_forward_hook(self._identity, with_kwargs=True)

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.active = False
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        bound = _bound(self.forward_parameters, args, kwargs)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bound.get("pixel_values") is not None)
        if all(everyone) or not any(everyone):
            return None
        has = bound.get("pixel_values") is not None
        mask = bound.get("cross_attention_mask")
        payload: list[dict[str, Any]] = [_to_cpu(
            {**{n: bound[n][:1] for n in self.IMAGE_INPUTS if bound.get(n) is not None},
             "mask_shape": tuple(mask.shape[2:]) if isinstance(mask, torch.Tensor) else None}) if has else {}]
        dist.broadcast_object_list(payload, src=everyone.index(True))
        if has:
            return None
        ids = bound.get("input_ids", bound.get("inputs_embeds"))
        if not isinstance(ids, torch.Tensor) or payload[0]["mask_shape"] is None:
            raise StandInError(f"{self.name}: a rank without images needs input_ids (or inputs_embeds) "
                               "and the others a cross_attention_mask to stand in for them")
        samples, length = ids.shape[:2]
        device = _device_of(module)
        kwargs = {k: v for k, v in kwargs.items() if k not in self.IMAGE_INPUTS}
        for name in self.IMAGE_INPUTS:
            if name in payload[0]:
                first = payload[0][name].to(device)
                kwargs[name] = first.repeat(samples, *([1] * (first.dim() - 1)))
        kwargs["cross_attention_mask"] = torch.zeros(samples, length, *payload[0]["mask_shape"],
                                                     dtype=torch.long, device=device)
        args = tuple(a for a in args if a is not bound.get("cross_attention_mask"))
        self.active = True
        self.stand_ins += 1
        return args, kwargs

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.active = False

    def _identity(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not self.active:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        if isinstance(output, tuple):
            return (ZeroContribution.apply(hidden, output[0]), *output[1:])
        return ZeroContribution.apply(hidden, output)


def _cross_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's layers that read images through cross-attention and that a
    text-only forward skips: those its text config lists as ``cross_attention_layers``
    (Mllama), in the ``layers`` list of the module holding that config."""
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    indices = getattr(text_config, "cross_attention_layers", None)
    if not isinstance(indices, (list, tuple)) or not indices:
        return []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if getattr(module, "config", None) is text_config and isinstance(layers, nn.ModuleList):
            return [layers[i] for i in indices if 0 <= i < len(layers)]
    return []


#: Forward arguments that carry media or describe it (``pixel_values``,
#: ``image_pixel_values``, ``input_features``, Fuyu's ``image_patches``, Kosmos-2.5's
#: ``flattened_patches``).
_MEDIA_ARGUMENT = re.compile(r"pixel|image|video|audio|speech|patches|input_features|input_values")


def _media_arguments(model: nn.Module) -> tuple[str, ...]:
    """The arguments of ``model.forward`` whose names say they carry media."""
    return tuple(n for n in _parameters(model.forward) if _MEDIA_ARGUMENT.search(n))


def _refusing(model: nn.Module) -> Callable[..., None]:
    """A pre-hook for a model that reads media and has no feature method: the ranks
    exchange which media arguments their batch carries, and all refuse together when
    they differ (a rank skipping the tower would hang the others)."""
    forward_parameters = _parameters(model.forward)
    names = _media_arguments(model) or ("pixel_values", "pixel_values_videos", "input_features", "input_values")
    model_name = _class_name(model)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        bound = _bound(forward_parameters, args, kwargs)
        present = tuple(bound.get(n) is not None for n in names)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, present)
        for index, name in enumerate(names):
            has = [flags[index] for flags in everyone]
            if any(has) and not all(has):
                raise StandInError(
                    f"ranks {[r for r, h in enumerate(has) if not h]} have no {name} in this step "
                    f"while others do, and {model_name} has no get_*_features method "
                    "through which annot could run its tower on every rank (a rank skipping it "
                    "hangs the others): give every rank's batch the same modalities")

    return hook


def _bound(names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward's arguments by name (positional ones named by ``names``, the forward's
    parameters)."""
    positional = [n for n in names if n not in kwargs]
    return {**dict(zip(positional, args, strict=False)), **kwargs}


def _class_name(model: nn.Module) -> str:
    """The name of ``model``'s own class: the hooks are installed after the engine
    wrapped the model, and FSDP2 re-classes a module as ``FSDP<Name>``."""
    return next((cls.__name__ for cls in type(model).__mro__ if not cls.__name__.startswith("FSDP")),
                type(model).__name__)


def _parameters(function: Callable[..., Any]) -> list[str]:
    try:
        return [n for n, p in inspect.signature(function).parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return []


#: The fields of a features method's output that transformers' models consume (the
#: features, projected; Qwen3-VL's deepstack features too), the first found that exist.
_CONSUMED = ("pooler_output", "deepstack_features")


def _language_layers(host: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``host``'s language model (``language_model.layers``), or
    none."""
    layers = getattr(getattr(host, "language_model", None), "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _injected(output: Any, layer_count: int) -> list[tuple[int, Any]]:
    """The features a model adds to a given language layer's input: deepstack pairs
    ``(layer index, features)`` (Granite-4-Vision), for a model whose language layers
    were found; else none. Of pairs naming the same layer only the last is used, as the
    model keeps them in a dict by layer (what it drops gets no gradient on the ranks with
    images, so the stand-in must not give it one)."""
    pairs = getattr(output, "deepstack_features", None)
    if not layer_count or not isinstance(pairs, (list, tuple)) or not pairs or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and 0 <= p[0] < layer_count
            for p in pairs):
        return []
    return list(dict(pairs).items())


def _consumed(output: Any, injected: bool = False) -> list[Any]:
    """What of a features method's output the model goes on to use, and so what the
    stand-in attaches: exactly those, because what is attached decides which
    parameters get a (zero) gradient, and a rank that gives a gradient to parameters
    the other ranks' step leaves without one (the tower's last layer when features come
    from an earlier one) or the other way round reduces a different set of tensors. The
    intermediate hidden states are never attached: given their gradient at once, a
    checkpointed block of the stand-in was recomputed before its turn and the ranks'
    all-gathers crossed (LLaVA-OneVision). ``injected``: the deepstack features go to
    their language layers instead (`_injected`), and what else is consumed is only
    what the output names (no last hidden state: Granite-4-Vision uses none)."""
    names = [name for name in _CONSUMED if not (injected and name == "deepstack_features")]
    found = [getattr(output, name) for name in names if getattr(output, name, None) is not None]
    if found or injected:
        return found
    last = getattr(output, "last_hidden_state", None)
    return [last] if last is not None else [output]


def _to_cpu(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _to_device(values: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _device_of(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its first parameter's (local) device."""
    for param in module.parameters():
        if param.device.type != "meta":  # a DTensor's is its local device
            return param.device
    return torch.device("cpu")
