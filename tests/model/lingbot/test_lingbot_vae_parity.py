"""Parity of the Wan VAE in its Wan2.1 layout (LingBot-World's: 16 latent channels, 8x in space,
no patchifying, plain up blocks) against diffusers' ``AutoencoderKLWan`` with the 2.1 config, on
a tiny random config in float32 on the CPU: encode (the first frame alone, then four at a time),
decode (one latent frame at a time, and larger chunks), and the image condition as LingBot builds
it (the image followed by black frames)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import AutoencoderKLWan

from mstar.model.wan22.vae import WanVAE, WanVAEConfig

TOL = 1e-5
TINY = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True, True], is_residual=False,
            latents_mean=[0.1, -0.2, 0.3, 0.05], latents_std=[1.5, 0.7, 2.0, 1.1])


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.fixture(scope="module")
def models():
    ref = AutoencoderKLWan(**TINY).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "gamma" in name else
                    0.1 * noise if p.ndim == 1 else noise * 1.2 / math.sqrt(p[0].numel()))
    config = WanVAEConfig.from_dict(dict(ref.config))
    assert not config.residual and config.patch_size == 1
    ours = WanVAE(config).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def test_encode_parity(models):
    ours, ref = models
    video = torch.rand(1, 3, 9, 16, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        check("encode", ours.encode(video), ref.encode(video).latent_dist.mode())
        cond = torch.cat([video[:, :, :1], torch.zeros(1, 3, 8, 16, 24)], dim=2)  # LingBot's i2v condition
        check("encode image + black frames", ours.encode(cond), ref.encode(cond).latent_dist.mode())


@pytest.mark.parametrize(("frames", "chunk"), [(1, 1), (4, 1), (4, 3)])
def test_decode_parity(models, frames, chunk):
    ours, ref = models
    latents = torch.randn(1, 4, frames, 2, 3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.decode(latents).sample
        got = ours.decode(latents, chunk=chunk)
    assert got.shape == (1, 3, 1 + 4 * (frames - 1), 16, 24)
    check(f"decode {frames} latent frames, chunk {chunk}", got, want)
