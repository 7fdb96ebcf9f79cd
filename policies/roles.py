"""The role of each part of a multimodal or encoder-decoder model: the vision tower, the
audio tower, the projector between a tower and the language model, the language model,
the encoder and the decoder of a sequence-to-sequence model, a diffusion model's
denoiser.

Roles are read from the model's structure, never from a table of model classes, and
transformers is never imported. A transformers composite model keeps one config per part
(``config.vision_config``, ``config.text_config``, ``config.audio_config``, ...) and each
part's module holds its own as ``module.config``: the module holding the sub-config
called ``vision_config`` is the vision tower, whatever the attribute is named
(``visual``, ``vision_tower``, ``vision_model``, ``image_encoder``). Without sub-configs,
names decide: a projector between a tower and the language model is named for it
(``multi_modal_projector``, ``connector``, ``aligner``, ``merger``, ...), a
sequence-to-sequence model's halves are ``encoder`` and ``decoder`` near the root (a
lone ``encoder``, BERT's, or ``decoder``, OPT's, is the whole model, no part of it). A
diffusers model (its class lives in ``diffusers``) is a denoiser, VAE or other model as a
whole. Each role is given to the outermost module that has it; everything inside has the
same role.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["ROLES", "TOWERS", "module_roles", "role_of"]

#: The roles named the same way for every model (other sub-configs give their own
#: name: ``dit_config`` -> ``"dit"``).
ROLES = ("vision", "audio", "projector", "language", "encoder", "decoder", "denoiser")
#: The roles of the parts that read a modality's raw input (pixels, audio features).
TOWERS = ("vision", "audio")

# Sub-config names (``vision_config``) -> role, the first pattern found in the name.
_CONFIG_ROLES = (
    (re.compile(r"vision|image|video|visual|vq|sam"), "vision"),
    (re.compile(r"audio|speech|acoustic|semantic_tokenizer"), "audio"),
    (re.compile(r"qformer|perceiver|projector|adapter|connector|aligner"), "projector"),
    (re.compile(r"^(text|language|llm|lm)"), "language"),
    (re.compile(r"^encoder"), "encoder"),
    (re.compile(r"^decoder"), "decoder"),
)
# The last name of a module's path -> role, where no sub-config says.
_PROJECTOR = re.compile(r"(multi_modal_projector|mm_projector|projector|connector|aligner|merger|"
                        r"language_projection|vision_projection|visual_projection|"
                        r"image_to_text_projection|vision_adapter|resampler)")
_NAMED = (
    (re.compile(r"(vision_tower|visual|vision_model|vision_encoder|image_encoder|image_tower|video_tower)"),
     "vision"),
    (re.compile(r"(audio_tower|audio_encoder|audio_model)"), "audio"),
    (re.compile(r"(text_encoder|encoder)"), "encoder"),
    (re.compile(r"(text_decoder|decoder)"), "decoder"),
    (re.compile(r"(language_model|text_model)"), "language"),
)
# Names looked for only this close to the root (``model.encoder`` of BART, ``encoder``
# of T5): deeper, ``encoder`` is a part of something else (a vision tower's layers).
_NAMED_DEPTH = 2


def _config_role(name: str) -> str:
    """The role of the part whose sub-config is called ``name``."""
    for pattern, role in _CONFIG_ROLES:
        if pattern.search(name):
            return role
    return name.removesuffix("_config")


def _sub_configs(model: nn.Module) -> dict[int, str]:
    """id of each sub-config of ``model``'s config -> its attribute name."""
    config = getattr(model, "config", None)
    names = getattr(config, "sub_configs", None) or {}
    out: dict[int, str] = {}
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            out[id(value)] = name
    return out


def module_roles(model: nn.Module) -> dict[str, str]:
    """Module path -> role for the outermost module of each part of ``model`` that has
    a role (`ROLES`, or a sub-config's own name), in module order; empty for a model of
    one part (a text-only language model, a model of the user's own). A diffusers model
    is one part: ``{"": "denoiser"}`` for a transformer or UNet class, else its class's
    kind (``"vae"`` for an autoencoder)."""
    module_name = type(model).__module__
    if module_name.startswith("diffusers."):
        kind = "vae" if "autoencoder" in module_name else "denoiser"
        return {"": kind}
    configs = _sub_configs(model)
    roles: dict[str, str] = {}
    halves: list[str] = []  # encoder and decoder found by name: kept only as a pair
    for path, module in model.named_modules():
        if not path or any(path == p or path.startswith(p + ".") for p in roles):
            continue
        if not any(True for _ in module.parameters()):
            continue
        config = getattr(module, "config", None)
        if config is not None and id(config) in configs and config is not getattr(model, "config", None):
            roles[path] = _config_role(configs[id(config)])
            continue
        last = path.rpartition(".")[2]
        if _PROJECTOR.fullmatch(last):
            roles[path] = "projector"
            continue
        if path.count(".") < _NAMED_DEPTH:
            role = next((r for pattern, r in _NAMED if pattern.fullmatch(last)), None)
            if role in ("encoder", "decoder") and not _holds_layers(module):
                role = None  # ALBERT's head names its output Linear ``decoder``
            if role is not None:
                roles[path] = role
                if role in ("encoder", "decoder"):
                    halves.append(path)
    if {roles[p] for p in halves} != {"encoder", "decoder"}:
        # BERT's ``bert.encoder``, OPT's ``model.decoder``: the whole model, not a half.
        roles = {p: r for p, r in roles.items() if p not in halves}
    return roles


def _holds_layers(module: nn.Module) -> bool:
    """Whether ``module`` holds a list of layers (an encoder or decoder does)."""
    return any(isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 0
               for child in module.modules())


def role_of(path: str, roles: dict[str, str]) -> str | None:
    """The role of the module at ``path``: its own or its nearest ancestor's."""
    best: tuple[int, str] | None = None
    for root, role in roles.items():
        if root == "" or path == root or path.startswith(root + "."):
            if best is None or len(root) > best[0]:
                best = (len(root), role)
    return best[1] if best is not None else None
