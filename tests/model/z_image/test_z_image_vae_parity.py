"""Parity of Z-Image's VAE (the FLUX.1 ``AutoencoderKL`` layout) against diffusers on tiny random
configs in float32 on the CPU: encode (posterior mean), decode and the latent normalisation,
with the FLUX.1 layout (no quant convolutions) and with diffusers' default (both present)."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL

from mstar.model.weights import WeightLoadError, load_weights
from mstar.model.z_image.vae import ZImageVAE, ZImageVAEConfig

TOL = 1e-5
TINY = dict(block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4,
            norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159)


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name and p.ndim == 1 else 0.2 * noise)


@pytest.fixture(scope="module", params=[False, True], ids=["flux1-layout", "with-quant-convs"])
def pair(request):
    quant = request.param
    ref = AutoencoderKL(**TINY, use_quant_conv=quant, use_post_quant_conv=quant).eval()
    randomize(ref, 5)
    ours = ZImageVAE(ZImageVAEConfig.from_dict(dict(ref.config))).eval()
    load_weights(ours, ref.state_dict().items())  # coverage checked both ways
    return ref, ours


def test_encode(pair):
    ref, ours = pair
    images = torch.rand(2, 3, 32, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        want = ref.encode(images).latent_dist.mean
        got = ours.encode(images)
    check("encode", got, want)
    cfg = ref.config
    check("normalize", ours.normalize(got), (want - cfg.shift_factor) * cfg.scaling_factor)


def test_decode(pair):
    ref, ours = pair
    latents = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.decode(latents / ref.config.scaling_factor + ref.config.shift_factor).sample
        got = ours.decode(ours.denormalize(latents))
    check("decode", got, want)


def test_flux1_layout_has_no_quant_convs():
    ref = AutoencoderKL(**TINY, use_quant_conv=True, use_post_quant_conv=True)
    ours = ZImageVAE(ZImageVAEConfig.from_dict({**ref.config, "use_quant_conv": False, "use_post_quant_conv": False}))
    with pytest.raises(WeightLoadError, match="quant_conv"):
        load_weights(ours, ref.state_dict().items())
