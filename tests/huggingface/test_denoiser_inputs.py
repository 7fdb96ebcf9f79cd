"""`denoiser_inputs` and `flow_matching_loss` on tiny Flux, SD3 and Wan transformers: the
layouts each class takes, a finite loss, fake-parameter models, and the refusals. The
probe (tests/huggingface/probe_denoisers.py) takes every class through a training step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from annot.huggingface.denoiser_inputs import denoiser_inputs, flow_matching_loss, served_classes
from tests.requires import installed

pytestmark = installed("diffusers")


def _tiny(name: str) -> nn.Module:
    from tests.huggingface.diffusers_configs import tiny_denoiser_config, transformer_classes

    torch.manual_seed(0)
    return transformer_classes()[name].from_config(tiny_denoiser_config(name))


@pytest.fixture(scope="module")
def flux() -> nn.Module:
    return _tiny("FluxTransformer2DModel")


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_flux_packs_two_by_two_patches_into_tokens(flux: nn.Module) -> None:
    inputs, target = denoiser_inputs(flux, batch=3, generator=_seeded(), latent_size=8, text_tokens=5)
    assert inputs["hidden_states"].shape == (3, 16, flux.config.in_channels)  # (8 / 2) ** 2 tokens
    assert inputs["img_ids"].shape == (16, 3) and inputs["txt_ids"].shape == (5, 3)
    assert inputs["encoder_hidden_states"].shape == (3, 5, flux.config.joint_attention_dim)
    assert inputs["pooled_projections"].shape == (3, flux.config.pooled_projection_dim)
    assert target.shape == inputs["hidden_states"].shape
    assert ((inputs["timestep"] > 0) & (inputs["timestep"] < 1)).all()  # Flux scales t by 1000 itself
    assert inputs["return_dict"] is False


def test_flux_noisy_latents_interpolate_data_and_noise(flux: nn.Module) -> None:
    # x_t = (1 - t) x0 + t noise and target = noise - x0: x_t + (1 - t) * target = noise,
    # x_t - t * target = x0; so the target and x_t span what the draw was.
    inputs, target = denoiser_inputs(flux, batch=2, generator=_seeded())
    t = inputs["timestep"].view(-1, 1, 1)
    x0 = inputs["hidden_states"] - t * target
    noise = x0 + target
    torch.testing.assert_close((1 - t) * x0 + t * noise, inputs["hidden_states"])


def test_flux_loss_is_finite_and_reproducible(flux: nn.Module) -> None:
    losses = [flow_matching_loss(flux, *denoiser_inputs(flux, batch=2, generator=_seeded(1))).item()
              for _ in range(2)]
    assert math.isfinite(losses[0]) and losses[0] == losses[1]


def test_sd3_takes_image_latents_and_scheduler_timesteps() -> None:
    model = _tiny("SD3Transformer2DModel")
    inputs, target = denoiser_inputs(model, batch=2, generator=_seeded(), latent_size=8)
    assert inputs["hidden_states"].shape == (2, model.config.in_channels, 8, 8)
    assert inputs["pooled_projections"].shape == (2, model.config.pooled_projection_dim)
    assert (inputs["timestep"] > 1).all()  # the pipeline passes t * 1000
    loss = flow_matching_loss(model, inputs, target)
    loss.backward()
    assert math.isfinite(loss.item()) and model.proj_out.weight.grad is not None


def test_wan_takes_video_latents() -> None:
    model = _tiny("WanTransformer3DModel")
    inputs, target = denoiser_inputs(model, batch=2, generator=_seeded(), latent_size=8, frames=3)
    assert inputs["hidden_states"].shape == (2, model.config.in_channels, 3, 8, 8)
    assert inputs["encoder_hidden_states"].shape[-1] == model.config.text_dim
    assert target.shape == inputs["hidden_states"].shape
    assert math.isfinite(flow_matching_loss(model, inputs, target).item())


def test_fake_parameters_give_fake_inputs_and_loss(flux: nn.Module) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    from annot.memory.activations import fake_copy

    fake, mode = fake_copy(flux, None)
    with mode:
        inputs, target = denoiser_inputs(fake, batch=2, generator=_seeded())
        loss = flow_matching_loss(fake, inputs, target)
    assert isinstance(inputs["hidden_states"], FakeTensor) and isinstance(loss, FakeTensor)
    assert loss.shape == ()


def test_inputs_follow_the_requested_dtype(flux: nn.Module) -> None:
    inputs, target = denoiser_inputs(flux, batch=1, generator=_seeded(), dtype=torch.bfloat16)
    assert inputs["hidden_states"].dtype == torch.bfloat16 and target.dtype == torch.float32


def test_refuses_a_module_that_is_no_diffusers_denoiser() -> None:
    with pytest.raises(ValueError, match="Linear: no training-step inputs"):
        denoiser_inputs(nn.Linear(2, 2), batch=1)


def test_refuses_a_transformer_that_is_no_denoiser() -> None:
    model = _tiny("MiniMaxMusic3RVQDepthDecoder")
    with pytest.raises(ValueError, match="MiniMaxMusic3RVQDepthDecoder: not a denoiser"):
        denoiser_inputs(model, batch=1)


def test_refuses_latents_the_patching_cannot_split(flux: nn.Module) -> None:
    with pytest.raises(ValueError, match="FluxTransformer2DModel: latent_size 7 is not a multiple of 2"):
        denoiser_inputs(flux, batch=1, latent_size=7)


def test_every_served_class_is_a_diffusers_transformer() -> None:
    from tests.huggingface.diffusers_configs import transformer_classes

    assert set(served_classes()) <= set(transformer_classes())
