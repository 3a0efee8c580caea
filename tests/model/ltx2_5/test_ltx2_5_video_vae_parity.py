"""Parity of the LTX-2 video VAE decoder against diffusers' ``AutoencoderKLLTX2Video`` on tiny
random configs in float32 on the CPU: the released layout (residual 2x2x2 upsamplers,
channel-halving), one with width-changing blocks, plain upsamplers of each kind and a
non-causal decoder, and one conditioned on the decode time."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video

from mstar.model.ltx2_5.video_vae import LtxVideoVae, LtxVideoVaeConfig
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
ENCODER = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1))
VARIANTS = {
    "released": dict(decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1)),
    "widths": dict(decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 2, 1, 1),
                   upsample_factor=(1, 1, 1), upsample_residual=False,
                   upsample_type=("spatial", "temporal", "spatiotemporal"), decoder_causal=False),
    "timed": dict(decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
                  timestep_conditioning=True),
}


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_video_decoder_parity(variant):
    ref = AutoencoderKLLTX2Video(latent_channels=4, **ENCODER, **VARIANTS[variant]).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    with torch.no_grad():
        ref.latents_mean.normal_(generator=torch.Generator().manual_seed(5))
        ref.latents_std.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(6))
    ours = LtxVideoVae(LtxVideoVaeConfig.from_dict(dict(ref.config))).eval()
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith("encoder.")}
    ours.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 4, 2, 2, 3, generator=gen) * 2
    t = torch.tensor([0.05, 0.2]) if ref.config.timestep_conditioning else None
    for causal in (True, False):
        with torch.no_grad():
            want = ref.decode(z, t, causal=causal, return_dict=False)[0]
            got = ours.decoder(z, t, causal=causal)
        check(f"{variant} causal={causal}", got, want)
    assert ours.config.spatial_ratio == ref.spatial_compression_ratio
    assert ours.config.temporal_ratio == ref.temporal_compression_ratio


def test_denormalize_follows_pipeline():
    from diffusers import LTX2Pipeline

    ref = AutoencoderKLLTX2Video(latent_channels=4, **ENCODER, **VARIANTS["released"])
    with torch.no_grad():
        ref.latents_mean.normal_(generator=torch.Generator().manual_seed(5))
        ref.latents_std.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(6))
    ours = LtxVideoVae(LtxVideoVaeConfig.from_dict({**dict(ref.config), "scaling_factor": 0.7}))
    ours.latents_mean.copy_(ref.latents_mean)
    ours.latents_std.copy_(ref.latents_std)
    z = torch.randn(1, 4, 2, 2, 2)
    want = LTX2Pipeline._denormalize_latents(z, ref.latents_mean, ref.latents_std, 0.7)
    torch.testing.assert_close(ours.denormalize(z), want)


def test_refuses_injected_noise():
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        LtxVideoVaeConfig.from_dict({"decoder_inject_noise": [False, True, False, False]})
