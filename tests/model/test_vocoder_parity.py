"""Parity of the shared vocoder parts (NSF source, iSTFT head, AdaIN residual blocks, the
iSTFTNet generator) against Kokoro's own modules (``kokoro==0.9.4``, ``kokoro.istftnet``).

Tiny random configs, float32 on the CPU. The source is random: both sides draw from the same
seed in the same order (torch's global generator for the reference, an explicit
``torch.Generator`` for ours), so waveforms compare sample by sample; a noise-free source is
checked against the reference with its random draws zeroed.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.vocoder import (
    ISTFT,
    AdaINResBlock1,
    HarmonicSource,
    ISTFTNetConfig,
    ISTFTNetGenerator,
    fold_weight_norm,
)
from mstar.model.weights import WeightLoadError, load_weights
from tests.support.vocoder import peak_err, perturbed, random_f0

istftnet = pytest.importorskip("kokoro.istftnet", reason="the reference: pip install kokoro==0.9.4")

TOL = 1e-4  # of the reference's peak
TINY = dict(
    style_dim=16,
    resblock_kernel_sizes=[3, 7],
    upsample_rates=[4, 2],
    upsample_initial_channel=32,
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
    upsample_kernel_sizes=[8, 4],
    gen_istft_n_fft=8,
    gen_istft_hop_size=2,
)

# Kokoro-82M's generator geometry (rates, kernels, iSTFT, residual kernels) at 32 channels
KOKORO_GEOMETRY = TINY | dict(
    resblock_kernel_sizes=[3, 7, 11],
    upsample_rates=[10, 6],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    upsample_kernel_sizes=[20, 12],
    gen_istft_n_fft=20,
    gen_istft_hop_size=5,
)


def tiny_config(shape: dict = TINY) -> ISTFTNetConfig:
    return ISTFTNetConfig(
        style_dim=shape["style_dim"],
        upsample_rates=tuple(shape["upsample_rates"]),
        upsample_kernel_sizes=tuple(shape["upsample_kernel_sizes"]),
        upsample_initial_channel=shape["upsample_initial_channel"],
        resblock_kernel_sizes=tuple(shape["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tuple(tuple(d) for d in shape["resblock_dilation_sizes"]),
        gen_istft_n_fft=shape["gen_istft_n_fft"],
        gen_istft_hop_size=shape["gen_istft_hop_size"],
    )


def test_harmonic_source_seeded():
    ref = perturbed(istftnet.SourceModuleHnNSF(24000, upsample_scale=24, harmonic_num=8, voiced_threshod=10))
    ours = HarmonicSource(24000, 24, harmonic_num=8, voiced_threshold=10).eval()
    load_weights(ours, ref.state_dict().items())
    f0 = random_f0(2, 10).repeat_interleave(24, dim=1).unsqueeze(-1)
    torch.manual_seed(7)
    want, _, _ = ref(f0)
    got = ours(f0, generator=torch.Generator().manual_seed(7))
    assert peak_err(got, want) <= 1e-6


def test_sine_source_noise_off_is_the_reference_without_draws(monkeypatch):
    ref = istftnet.SineGen(24000, 24, harmonic_num=4, voiced_threshold=10)
    ours = HarmonicSource(24000, 24, harmonic_num=4, voiced_threshold=10).l_sin_gen
    f0 = random_f0(2, 10).repeat_interleave(24, dim=1).unsqueeze(-1)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(*a, **k))
    monkeypatch.setattr(torch, "randn_like", torch.zeros_like)
    want, want_uv, _ = ref(f0)
    got, got_uv = ours(f0, noise=False)
    assert torch.equal(got_uv, want_uv)
    assert peak_err(got, want) <= 1e-6


def test_istft_head_matches_torch_stft_module():
    ref = istftnet.TorchSTFT(filter_length=16, hop_length=4, win_length=16)
    ours = ISTFT(16, 4)
    signal = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    want_mag, want_phase = ref.transform(signal)
    got_mag, got_phase = ours.analyse(signal)
    assert torch.equal(got_mag, want_mag) and torch.equal(got_phase, want_phase)
    assert peak_err(ours.synthesise(got_mag, got_phase), ref.inverse(want_mag, want_phase)) <= 1e-6


def test_adain_resblock():
    ref = perturbed(istftnet.AdaINResBlock1(12, 5, (1, 3, 5), style_dim=6))
    ours = AdaINResBlock1(12, 5, (1, 3, 5), style_dim=6).eval()
    load_weights(ours, fold_weight_norm(ref.state_dict()).items())
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(2, 12, 40, generator=g), torch.randn(2, 6, generator=g)
    with torch.no_grad():
        assert peak_err(ours(x, s), ref(x, s)) <= 1e-5


def build_generators(shape: dict, seed: int = 0) -> tuple[torch.nn.Module, ISTFTNetGenerator]:
    torch.manual_seed(seed)
    ref = perturbed(istftnet.Generator(**shape), seed)
    ours = ISTFTNetGenerator(tiny_config(shape)).eval()
    load_weights(ours, fold_weight_norm(ref.state_dict()).items())  # coverage both ways
    return ref, ours


@pytest.mark.parametrize(("shape", "batch", "frames"),
                         [(TINY, 1, 14), (TINY, 2, 14), (KOKORO_GEOMETRY, 1, 6)], ids=["tiny", "tiny-b2", "kokoro"])
def test_generator_waveform(shape: dict, batch: int, frames: int):
    ref, ours = build_generators(shape)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, shape["upsample_initial_channel"], frames, generator=g)
    s = torch.randn(batch, shape["style_dim"], generator=g)
    f0 = random_f0(batch, frames)
    with torch.no_grad():
        torch.manual_seed(11)
        want = ref(x, s, f0)
        got = ours(x, s, f0, generator=torch.Generator().manual_seed(11))
    assert got.shape == (batch, 1, frames * tiny_config(shape).samples_per_frame)
    err = peak_err(got, want)
    print(f"[vocoder parity] generator batch {batch}, {frames} frames: {err:.2e} of peak")
    assert err <= TOL


def test_fold_weight_norm_names_a_lone_half():
    conv = torch.nn.utils.weight_norm(torch.nn.Conv1d(2, 3, 3))
    state = dict(conv.state_dict())
    folded = fold_weight_norm(state)
    assert set(folded) == {"weight", "bias"}
    assert torch.allclose(folded["weight"], conv.weight, atol=1e-7)
    del state["weight_v"]
    with pytest.raises(WeightLoadError, match="weight_g"):
        fold_weight_norm(state)
