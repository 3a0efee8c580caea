"""The causal HiFT (CosyVoice3's streaming vocoder, ``HiFTConfig(causal=True)``).

There is no pip reference for it (``cosyvoice-minicpmo`` is CosyVoice2's code), so these
tests check its invariant only: decoding the mel received so far with ``finalize=False``
gives a prefix of the whole-utterance decode, and the pieces a stream emits join up to it.
Tiny random config, float32 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.vocoder import HiFTConfig, HiFTGenerator
from tests.support.vocoder import peak_err, perturbed

CAUSAL = HiFTConfig(
    in_channels=12,
    base_channels=32,
    upsample_rates=(4, 3),
    upsample_kernel_sizes=(8, 7),
    n_fft=8,
    hop_length=2,
    resblock_kernel_sizes=(3, 5),
    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    source_resblock_kernel_sizes=(7, 11),
    source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    f0_cond_channels=16,
    causal=True,
)
HELD_BACK = 3 + CAUSAL.conv_pre_look_right + 1  # frames a non-final call does not emit yet


def causal_generator(config: HiFTConfig = CAUSAL, seed: int = 0) -> HiFTGenerator:
    """Perturbed random weights, F0 around 100 Hz, and the predicted log-magnitude shrunk and lowered so
    the waveform stays clear of the +-0.99 clamp (which would hide differences)."""
    torch.manual_seed(seed)  # the initial weights too: not whatever an earlier test left the global RNG at
    gen = perturbed(HiFTGenerator(config), seed)
    with torch.no_grad():
        gen.f0_predictor.classifier.weight.mul_(60.0)
        gen.f0_predictor.classifier.bias.fill_(100.0)
        gen.conv_post.weight[: gen.stft.bins] *= 0.2
        gen.conv_post.bias[: gen.stft.bins] -= 3.0
    return gen


def unclamped(wave: torch.Tensor) -> bool:
    """At most 1% of the samples at the clamp (random weights can saturate the output)."""
    return (wave.abs() >= CAUSAL.audio_limit).float().mean().item() <= 0.01


def test_keeps_the_non_causal_parameter_names():
    causal = HiFTGenerator(CAUSAL).state_dict()
    plain = HiFTGenerator(HiFTConfig(**{**CAUSAL.__dict__, "causal": False})).state_dict()
    assert causal.keys() == plain.keys()
    assert causal["conv_pre.weight"].shape[-1] == CAUSAL.conv_pre_look_right + 1
    assert causal["f0_predictor.condnet.0.weight"].shape[-1] == 4


@pytest.mark.parametrize("batch", [1, 2])
def test_every_partial_decode_is_a_prefix_of_the_whole(batch: int):
    gen = causal_generator()
    frames = 40
    mel = torch.randn(batch, CAUSAL.in_channels, frames, generator=torch.Generator().manual_seed(1))
    spf = CAUSAL.samples_per_frame
    with torch.no_grad():
        whole, _ = gen(mel)
        assert whole.shape == (batch, frames * spf)
        assert unclamped(whole)
        for received in range(HELD_BACK + 1, frames, 3):
            part, _ = gen(mel[..., :received], finalize=False)
            assert part.shape == (batch, (received - HELD_BACK) * spf)
            assert peak_err(part, whole[:, : part.shape[-1]]) <= 1e-5, received  # measured: 0 (bitwise equal)


def test_streamed_pieces_join_to_the_whole():
    """The CosyVoice3 loop: rerun the mel so far, emit what is new, finalise at the end."""
    gen = causal_generator(seed=3)
    frames, chunk = 37, 6
    mel = torch.randn(1, CAUSAL.in_channels, frames, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole, _ = gen(mel)
        assert unclamped(whole)
        pieces, emitted, received = [], 0, 0
        while received < frames:
            received = min(received + chunk, frames)
            final = received == frames
            if not final and received <= HELD_BACK:
                continue
            wave, _ = gen(mel[..., :received], finalize=final)
            pieces.append(wave[:, emitted:])
            emitted = wave.shape[-1]
    streamed = torch.cat(pieces, dim=-1)
    err = peak_err(streamed, whole)
    print(f"[hift causal] {len(pieces)} pieces vs whole: {err:.2e} of peak")
    assert err <= 1e-5


def test_future_mel_does_not_change_the_past():
    gen = causal_generator()
    mel = torch.randn(1, CAUSAL.in_channels, 30, generator=torch.Generator().manual_seed(4))
    changed = mel.clone()
    changed[..., 20:] += 1.0
    keep = (20 - 3 - CAUSAL.conv_pre_look_right - 1) * CAUSAL.samples_per_frame
    with torch.no_grad():
        a, _ = gen(mel)
        b, _ = gen(changed)
    assert torch.equal(a[:, :keep], b[:, :keep])
    assert not torch.equal(a, b)


def test_non_causal_refuses_to_stream():
    gen = HiFTGenerator(HiFTConfig(**{**CAUSAL.__dict__, "causal": False}))
    with pytest.raises(ValueError, match="causal"):
        gen(torch.zeros(1, CAUSAL.in_channels, 12), finalize=False)
