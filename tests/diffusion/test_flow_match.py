"""Parity of ``FlowMatchEuler`` with diffusers' ``FlowMatchEulerDiscreteScheduler`` as the FLUX.2
pipelines drive it (diffusers 0.42.1).

Scheduler config: diffusers ships no FLUX.2 scheduler config; its conversion script
(``scripts/convert_flux2_to_diffusers.py``) builds ``Flux2Pipeline`` with the FLUX.1-dev scheduler
config, reproduced in ``FLUX2_SCHEDULER_CONFIG``. With ``use_dynamic_shifting`` on, the pipeline
passes its own ``sigmas`` and ``mu``, so ``shift`` / ``base_shift`` / ``max_shift`` / the sequence
length bounds do not affect the schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.pipeline_flux2_klein import (
    compute_empirical_mu,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from mstar.diffusion import FlowMatchEuler, empirical_mu

FLUX2_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
TOL = 1e-6
STEPS = [1, 2, 4, 8, 28, 50]
SIZES = [(256, 256), (512, 512), (1024, 1024), (768, 1360), (1536, 1536), (2048, 2048)]


def reference_schedule(
    num_steps: int, image_seq_len: int, config: dict = FLUX2_SCHEDULER_CONFIG
) -> FlowMatchEulerDiscreteScheduler:
    """A diffusers scheduler after the FLUX.2 pipeline's step 6 ("Prepare timesteps")."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)
    retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return scheduler


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_from_config_is_the_default() -> None:
    assert FlowMatchEuler.from_config(FLUX2_SCHEDULER_CONFIG) == FlowMatchEuler()
    with pytest.raises(ValueError):
        FlowMatchEuler.from_config({**FLUX2_SCHEDULER_CONFIG, "use_karras_sigmas": True})


@pytest.mark.parametrize("num_steps", STEPS)
def test_schedule_matches_diffusers(num_steps: int) -> None:
    sched = FlowMatchEuler()
    worst = 0.0
    for height, width in SIZES:
        seq_len = (height // 16) * (width // 16)  # tokens of the packed latent
        ref = reference_schedule(num_steps, seq_len)
        sigmas, timesteps = sched.timesteps(num_steps, seq_len)
        assert sigmas.shape == (num_steps + 1,) and timesteps.shape == (num_steps,)
        assert sigmas.dtype == timesteps.dtype == torch.float32
        torch.testing.assert_close(sigmas, ref.sigmas, rtol=TOL, atol=TOL)
        torch.testing.assert_close(timesteps, ref.timesteps, rtol=TOL, atol=TOL)
        assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
        worst = max(worst, max_err(sigmas, ref.sigmas), max_err(timesteps, ref.timesteps) / 1000)
    print(f"[flow match] {num_steps} steps: max |sigma - ref| {worst:.1e}")


def test_empirical_mu_matches_pipeline() -> None:
    for seq_len in [1, 64, 256, 1024, 4096, 4300, 4301, 16384]:
        for steps in [1, 4, 50, 200]:
            want = compute_empirical_mu(seq_len, steps)
            assert empirical_mu(seq_len, steps) == pytest.approx(want, abs=1e-12)


def test_overrides_and_static_shift_match_diffusers() -> None:
    custom = [1.0, 0.8, 0.5, 0.2]
    ref = FlowMatchEulerDiscreteScheduler.from_config(FLUX2_SCHEDULER_CONFIG)
    retrieve_timesteps(ref, 4, "cpu", sigmas=custom, mu=0.7)
    sigmas, timesteps = FlowMatchEuler().timesteps(4, 1024, mu=0.7, sigmas=custom)
    torch.testing.assert_close(sigmas, ref.sigmas, rtol=TOL, atol=TOL)
    torch.testing.assert_close(timesteps, ref.timesteps, rtol=TOL, atol=TOL)

    static = {**FLUX2_SCHEDULER_CONFIG, "use_dynamic_shifting": False}
    ref = FlowMatchEulerDiscreteScheduler.from_config(static)
    retrieve_timesteps(ref, 6, "cpu", sigmas=np.linspace(1.0, 1 / 6, 6))
    sigmas, timesteps = FlowMatchEuler.from_config(static).timesteps(6, 1024)
    torch.testing.assert_close(sigmas, ref.sigmas, rtol=TOL, atol=TOL)
    torch.testing.assert_close(timesteps, ref.timesteps, rtol=TOL, atol=TOL)


def velocity_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A fixed, non-trivial stand-in for the DiT."""
    return torch.tanh(x) * (t / 1000) - 0.3 * x + torch.cos(t / 250)


def test_euler_loop_matches_diffusers() -> None:
    num_steps, seq_len = 4, 1024
    x0 = FlowMatchEuler.initial_noise((2, seq_len, 16), seed=3)
    ref = reference_schedule(num_steps, seq_len)
    x_ref = x0.clone()
    for t in ref.timesteps:
        x_ref = ref.step(velocity_fn(x_ref, t), t, x_ref, return_dict=False)[0]

    sigmas, timesteps = FlowMatchEuler().timesteps(num_steps, seq_len)
    x = x0.clone()
    for i in range(num_steps):  # the loop-carried state is (x, i, sigmas)
        x = FlowMatchEuler.step(x, velocity_fn(x, timesteps[i]), sigmas[i], sigmas[i + 1])
    err = max_err(x, x_ref) / x_ref.abs().max().item()
    print(f"[flow match] 4-step Euler loop: max rel err {err:.1e}")
    assert err <= TOL
    assert torch.equal(x0, FlowMatchEuler.initial_noise((2, seq_len, 16), seed=3))  # not mutated


def test_batched_step_with_per_request_sigmas_equals_single_steps() -> None:
    # Two requests at different steps of different schedules, stepped in one batch.
    s_a, _ = FlowMatchEuler().timesteps(4, 256)
    s_b, _ = FlowMatchEuler().timesteps(28, 4096)
    sigma = torch.stack([s_a[1], s_b[17]])
    sigma_next = torch.stack([s_a[2], s_b[18]])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 64, 16).to(dtype)
        v = torch.randn(2, 64, 16).to(dtype)
        batched = FlowMatchEuler.step(x, v, sigma, sigma_next)
        for row in range(2):
            one = slice(row, row + 1)
            alone = FlowMatchEuler.step(x[one], v[one], sigma[row], sigma_next[row])
            assert torch.equal(batched[one], alone)
        assert batched.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_is_bit_identical_to_diffusers(dtype: torch.dtype) -> None:
    ref = reference_schedule(4, 1024)
    sigmas, _ = FlowMatchEuler().timesteps(4, 1024)
    x = torch.randn(1, 1024, 128).to(dtype)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(1, 1024, 128).to(dtype)
        want = ref.step(v, t, x, return_dict=False)[0]
        got = FlowMatchEuler.step(x, v, sigmas[i], sigmas[i + 1])
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want), (dtype, i)
        x = want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_initial_noise_matches_pipeline_draw(dtype: torch.dtype) -> None:
    shape = (1, 128, 32, 48)  # patchified latent of a 512x768 image, as prepare_latents draws it
    for seed in (0, 42, 2**40 + 7):
        generator = torch.Generator().manual_seed(seed)
        want = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=dtype)
        got = FlowMatchEuler.initial_noise(shape, seed, "cpu", dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    # Per-request generators: a request's noise does not depend on what else was drawn.
    a = FlowMatchEuler.initial_noise(shape, 1)
    FlowMatchEuler.initial_noise(shape, 2)
    assert torch.equal(a, FlowMatchEuler.initial_noise(shape, 1))


def test_pipeline_denoise_loop_parity() -> None:
    """Our noise + schedule + Euler steps + unpacking reproduce ``Flux2KleinPipeline``'s latents
    (``output_type="latent"``) with a tiny random DiT and VAE, given the same seed."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    from mstar.model.flux2.vae import (
        Flux2VAE,
        Flux2VAEConfig,
        to_tokens,
        token_grid,
        unpack_latents,
    )

    torch.manual_seed(0)
    vae_kwargs = {
        "block_out_channels": (8, 16),
        "down_block_types": ("DownEncoderBlock2D",) * 2,
        "up_block_types": ("UpDecoderBlock2D",) * 2,
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 4,
    }
    vae = AutoencoderKLFlux2(**vae_kwargs).eval()
    with torch.no_grad():
        vae.bn.running_mean.normal_()
        vae.bn.running_var.uniform_(0.5, 2.0)
    dit = Flux2Transformer2DModel(
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX2_SCHEDULER_CONFIG)
    pipe = Flux2KleinPipeline(scheduler, vae, None, None, dit, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    prompt = torch.randn(1, 5, 32)
    height, width, steps, seed = 32, 48, 4, 7
    want = pipe(
        prompt_embeds=prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        return_dict=False,
    )[0]

    ours_vae = Flux2VAE(Flux2VAEConfig.from_dict(dict(vae.config)))
    ours_vae.load_state_dict(vae.state_dict(), strict=True)
    rows, cols = token_grid(height, width, ours_vae.config.scale_factor)
    x = to_tokens(FlowMatchEuler.initial_noise((1, 16, rows, cols), seed))
    sigmas, timesteps = FlowMatchEuler().timesteps(steps, rows * cols)
    txt_ids = Flux2KleinPipeline._prepare_text_ids(prompt)
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, 16, rows, cols))
    with torch.no_grad():
        for i in range(steps):
            v = dit(
                hidden_states=x,
                timestep=(timesteps[i] / 1000).expand(1),
                guidance=None,
                encoder_hidden_states=prompt,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
            x = FlowMatchEuler.step(x, v, sigmas[i], sigmas[i + 1])
        got = unpack_latents(x, rows, cols, *ours_vae.latent_norm())
    assert got.shape == want.shape == (1, 4, 2 * rows, 2 * cols)
    err = max_err(got, want) / want.abs().max().item()
    print(f"[flow match] tiny Flux2KleinPipeline latents: max rel err {err:.1e}")
    assert err <= 1e-5
