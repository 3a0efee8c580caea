"""Z-Image's schedule against diffusers' scheduler as ZImagePipeline sets it up: the sigmas, and
the DiT time ``(1000 - timestep) / 1000`` the pipeline feeds the transformer, bit for bit, for the
Turbo config (static shift 3) and a dynamic-shifting config (mu from the linear fit)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

from mstar.model.z_image.schedule import TURBO_SCHEDULER, ZImageSchedule

DYNAMIC = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "base_shift": 0.4, "max_shift": 1.3,
           "base_image_seq_len": 128, "max_image_seq_len": 8192}


@pytest.mark.parametrize("config", [TURBO_SCHEDULER, DYNAMIC], ids=["turbo", "dynamic"])
@pytest.mark.parametrize("steps, seq_len", [(8, 4096), (3, 24), (50, 1000)])
def test_schedule_matches_the_pipeline(config, steps, seq_len):
    reference = FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = calculate_shift(seq_len, reference.config.get("base_image_seq_len", 256),
                         reference.config.get("max_image_seq_len", 4096), reference.config.get("base_shift", 0.5),
                         reference.config.get("max_shift", 1.15))
    reference.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
    sigmas, dit_time = ZImageSchedule.from_config(config).timesteps(steps, seq_len)
    assert torch.equal(sigmas, reference.sigmas)
    assert torch.equal(dit_time / 1000, (1000 - reference.timesteps) / 1000)


def test_turbo_is_static_shift_three():
    schedule = ZImageSchedule.from_config(TURBO_SCHEDULER)
    assert not schedule.dynamic_shifting and schedule.shift == 3.0
    small, _ = schedule.timesteps(8, 16)
    large, _ = schedule.timesteps(8, 16384)
    assert torch.equal(small, large)  # no resolution dependence
