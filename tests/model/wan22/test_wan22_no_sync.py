"""A Wan denoise step never makes the host wait for the GPU (torch's sync debug mode "error"),
so the host launches step k+1 while the GPU still runs step k: the UniPC scalars stay on the
host (0-dim tensors enter GPU ops as values), the DiT's per-token times are made on the GPU and
embedded without ``torch.unique``. Parity with diffusers is test_wan22_walk.py's."""

from __future__ import annotations

import pytest
import torch

from mstar.diffusion.unipc import UniPC
from mstar.engine.base import EngineItem
from mstar.model.wan22.config import WanTransformerConfig
from mstar.model.wan22.denoise import WanDenoiseEngine
from mstar.model.wan22.transformer import WanTransformer
from tests.model.wan22.conftest import DIT, SCHEDULER
from tests.support.markers import needs_cuda


def build(device: torch.device) -> tuple[WanDenoiseEngine, dict[str, torch.Tensor]]:
    """A tiny DiT's denoise engine on ``device`` and one request's inputs (made before the steps:
    moving a module to the GPU is itself a copy up)."""
    torch.manual_seed(0)
    dit = WanTransformer(WanTransformerConfig.from_dict(DIT)).to(device).eval()
    engine = WanDenoiseEngine(lambda x, t, prompt: dit(x, t, prompt=prompt), UniPC.from_config(SCHEDULER), (1, 2, 2),
                              device, encode=dit.prompt_keys)
    inputs = {"latents": torch.randn(4, 2, 4, 6, device=device), "text": torch.randn(5, 32, device=device),
              "negative_text": torch.randn(5, 32, device=device)}
    return engine, inputs


def run_steps(engine: WanDenoiseEngine, inputs: dict[str, torch.Tensor], request: str, steps: int = 4) -> torch.Tensor:
    params = {"num_steps": steps, "guidance_scale": 3.0}
    latents = inputs["latents"]
    for k in range(steps):
        item = EngineItem(request, "step", k, {**inputs, "latents": latents}, params)
        latents = engine.run([item])[0].outputs["latents"]
    return latents


@needs_cuda
def test_guided_steps_do_not_wait_for_the_gpu():
    engine, inputs = build(torch.device("cuda"))
    warm = run_steps(engine, inputs, "warm-up")  # first-use allocations and library loads
    torch.cuda.set_sync_debug_mode("error")
    try:
        latents = run_steps(engine, inputs, "timed")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(latents, warm)


def test_a_third_time_in_a_row_is_refused():
    """The time embedding takes each row's two extremes: a third value is an error, not a
    silently wrong embedding."""
    dit = WanTransformer(WanTransformerConfig.from_dict(DIT)).eval()
    with torch.no_grad():
        dit(torch.randn(1, 4, 2, 4, 6), torch.tensor([[0.0] * 6 + [700.0] * 6]), torch.randn(1, 5, 32))
        with pytest.raises(RuntimeError, match="more than two values"):
            dit(torch.randn(1, 4, 2, 4, 6), torch.tensor([[0.0] * 4 + [500.0] * 2 + [700.0] * 6]),
                torch.randn(1, 5, 32))
