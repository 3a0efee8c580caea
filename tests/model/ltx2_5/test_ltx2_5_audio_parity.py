"""Parity of the LTX-2 audio path against diffusers on tiny random configs in float32 on the
CPU: the audio VAE decoder (``AutoencoderKLLTX2Audio``: causal pixel-norm layout, and a
group-norm one with attention), the 24 kHz generator (``LTX2Vocoder``: leaky ReLU; Snake
anti-aliased) and the 48 kHz bandwidth-extended vocoder (``LTX2VocoderWithBWE``)."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLLTX2Audio
from diffusers.pipelines.ltx2 import LTX2Pipeline
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

from mstar.model.ltx2_5.audio_vae import LtxAudioVae, LtxAudioVaeConfig
from mstar.model.ltx2_5.vocoder import build_vocoder
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
AUDIO_VAE = {
    "causal_pixel": dict(base_channels=8, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, mel_bins=16),
    "group_attn": dict(base_channels=32, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, mel_bins=None,
                       norm_type="group", causality_axis="none", attn_resolutions=(8,), resolution=16,
                       mid_block_add_attention=True),
}
GENERATOR = {
    "leaky": dict(in_channels=8, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                  resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3], [1, 2]]),
    "snake": dict(in_channels=8, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
                  resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], act_fn="snake", antialias=True,
                  final_act_fn=None, final_bias=False),
}
BWE = dict(in_channels=8, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
           resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], bwe_in_channels=8, bwe_hidden_channels=8,
           bwe_upsample_kernel_sizes=[6, 4], bwe_upsample_factors=[6, 2], bwe_resnet_kernel_sizes=[3],
           bwe_resnet_dilations=[[1]], filter_length=16, hop_length=4, window_length=16, num_mel_channels=4)


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


@pytest.mark.parametrize("variant", sorted(AUDIO_VAE))
def test_audio_vae_decoder_parity(variant):
    ref = AutoencoderKLLTX2Audio(**AUDIO_VAE[variant]).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    with torch.no_grad():
        ref.latents_mean.normal_(generator=torch.Generator().manual_seed(5))
        ref.latents_std.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(6))
    ours = LtxAudioVae(LtxAudioVaeConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("encoder.")}, strict=True)
    frames, bins = 5, ref.config.base_channels // 4  # the statistics cover channels x bins
    tokens = torch.randn(2, frames, 4 * bins, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        latents = LTX2Pipeline._denormalize_audio_latents(tokens, ref.latents_mean, ref.latents_std)
        want = ref.decode(LTX2Pipeline._unpack_audio_latents(latents, frames, num_mel_bins=bins),
                          return_dict=False)[0]
        got = ours.decode(tokens)
    check(f"audio vae {variant}", got, want)


@pytest.mark.parametrize("variant", sorted(GENERATOR))
def test_generator_parity(variant):
    ref = LTX2Vocoder(**GENERATOR[variant]).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    ours = build_vocoder(dict(ref.config)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    mel = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        check(f"vocoder {variant}", ours(mel), ref(mel))


def test_bandwidth_extended_vocoder_parity():
    ref = LTX2VocoderWithBWE(**BWE).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the STFT bases and the filterbank are checkpoint buffers (zeros at init)
        ref.mel_stft.stft_fn.forward_basis.normal_(generator=gen)
        ref.mel_stft.mel_basis.uniform_(0.0, 1.0, generator=gen)
    config = {"_class_name": "LTX2VocoderWithBWE", **dict(ref.config)}
    ours = build_vocoder(config).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert ours.sampling_rate == 48000
    mel = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(1)) * 0.3
    with torch.no_grad():
        want = ref(mel)
        got = ours(mel)
    assert got.shape[-1] == 6 * 4 * 3  # 4x the mel frames at 16 kHz, then x3
    check("vocoder bwe", got, want)
