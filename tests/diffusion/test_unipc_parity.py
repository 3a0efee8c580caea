"""Parity of our UniPC sampler against diffusers' ``UniPCMultistepScheduler`` at the Wan
pipelines' settings (flow sigmas and prediction, bh2, order 2, lower order at the end): the
schedule, and whole sampling runs driven by a fixed velocity field, in float32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from mstar.diffusion.unipc import UniPC, UniPCState

WAN_SCHEDULER = {"_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear",
                 "beta_start": 0.0001, "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
                 "final_sigmas_type": "zero", "flow_shift": 5.0, "lower_order_final": True,
                 "num_train_timesteps": 1000, "predict_x0": True, "prediction_type": "flow_prediction",
                 "rescale_betas_zero_snr": False, "sample_max_value": 1.0, "solver_order": 2, "solver_p": None,
                 "solver_type": "bh2", "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
                 "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False,
                 "use_flow_sigmas": True, "use_karras_sigmas": False}


def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth nonlinear stand-in for the DiT."""
    return torch.tanh(x * 0.7 + t.float() / 700) - 0.3 * x


@pytest.mark.parametrize("steps", [1, 2, 3, 7])
@pytest.mark.parametrize("overrides", [{}, {"flow_shift": 3.0, "disable_corrector": [1]}])
def test_sampling_matches_diffusers(steps, overrides):
    config = {**WAN_SCHEDULER, **overrides}
    ref = UniPCMultistepScheduler.from_config(config)
    ref.set_timesteps(steps)
    ours = UniPC.from_config(config)
    sigmas, timesteps = ours.timesteps(steps)
    assert torch.equal(timesteps, ref.timesteps)
    assert torch.equal(sigmas, ref.sigmas)

    x_ref = torch.randn(1, 4, 2, 3, 5, generator=torch.Generator().manual_seed(steps))
    x, state = x_ref.clone(), UniPCState()
    for i, t in enumerate(ref.timesteps):
        x_ref = ref.step(velocity(x_ref, t), t, x_ref, return_dict=False)[0]
        x, state = ours.step(i, sigmas, velocity(x, timesteps[i]), x, state)
        err = ((x - x_ref).abs().max() / x_ref.abs().max()).item()
        assert err <= 1e-6, f"step {i}: relative error {err:.2e}"


def test_refuses_options_it_lacks():
    with pytest.raises(ValueError, match="prediction_type"):
        UniPC.from_config({**WAN_SCHEDULER, "prediction_type": "epsilon"})
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        UniPC.from_config({**WAN_SCHEDULER, "use_karras_sigmas": True})
