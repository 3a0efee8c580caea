"""Parity of the HiFT vocoder (``mstar.model.vocoder.hift``) against CosyVoice2's own modules
(``cosyvoice-minicpmo==0.1.0``: ``cosyvoice.hifigan.generator`` and ``.f0_predictor``). That
package imports beside torch 2.13; its hifigan modules need only scipy beyond torch:
``pip install --no-deps cosyvoice-minicpmo==0.1.0`` (its declared dependencies are a whole
training stack and are not wanted).

Tiny random configs, float32 on the CPU. The source is random: both sides draw from the same
seed in the same order (torch's global generator for the reference, an explicit
``torch.Generator`` for ours), so waveforms compare sample by sample.
"""

from __future__ import annotations

import pytest
import torch

from mstar.model.vocoder import F0Predictor, HarmonicSource, HiFTConfig, HiFTGenerator, SnakeResBlock, hift_state
from mstar.model.weights import WeightLoadError, load_weights
from tests.support.vocoder import peak_err, perturbed, random_f0

generator_ref = pytest.importorskip(
    "cosyvoice.hifigan.generator", reason="the reference: pip install --no-deps cosyvoice-minicpmo==0.1.0"
)
f0_ref = pytest.importorskip("cosyvoice.hifigan.f0_predictor")

TOL = 1e-4  # of the reference's peak
TINY = dict(
    in_channels=12,
    base_channels=32,
    nb_harmonics=8,
    sampling_rate=24000,
    upsample_rates=[4, 3],
    upsample_kernel_sizes=[8, 7],
    istft_params={"n_fft": 8, "hop_len": 2},
    resblock_kernel_sizes=[3, 5],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
    source_resblock_kernel_sizes=[7, 11],
    source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
)
# CosyVoice2-0.5B's geometry (rates, kernels, iSTFT, residual kernels) at 32 channels
COSYVOICE2_GEOMETRY = TINY | dict(
    upsample_rates=[8, 5, 3],
    upsample_kernel_sizes=[16, 11, 7],
    istft_params={"n_fft": 16, "hop_len": 4},
    resblock_kernel_sizes=[3, 7, 11],
    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    source_resblock_kernel_sizes=[7, 7, 11],
    source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
)
# The reference picks the per-sample sine source (CosyVoice1's, and Chatterbox S3Gen's at
# 24 kHz) when the rate is 22050 Hz; ours takes it as per_sample_source.
PER_SAMPLE = TINY | dict(sampling_rate=22050)
COND = 16  # the F0 predictor's width


def our_config(shape: dict) -> HiFTConfig:
    return HiFTConfig(
        in_channels=shape["in_channels"],
        base_channels=shape["base_channels"],
        nb_harmonics=shape["nb_harmonics"],
        sampling_rate=shape["sampling_rate"],
        upsample_rates=tuple(shape["upsample_rates"]),
        upsample_kernel_sizes=tuple(shape["upsample_kernel_sizes"]),
        n_fft=shape["istft_params"]["n_fft"],
        hop_length=shape["istft_params"]["hop_len"],
        resblock_kernel_sizes=tuple(shape["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tuple(map(tuple, shape["resblock_dilation_sizes"])),
        source_resblock_kernel_sizes=tuple(shape["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=tuple(map(tuple, shape["source_resblock_dilation_sizes"])),
        f0_cond_channels=COND,
        per_sample_source=shape["sampling_rate"] == 22050,
    )


def reference_generator(shape: dict, seed: int = 0) -> torch.nn.Module:
    """The reference HiFT with perturbed weights; its F0 head is biased to about 100 Hz so the
    predicted source is voiced (unvoiced stretches: ``test_decode_with_unvoiced_...``)."""
    torch.manual_seed(seed)
    f0 = f0_ref.ConvRNNF0Predictor(in_channels=shape["in_channels"], cond_channels=COND)
    ref = perturbed(generator_ref.HiFTGenerator(**shape, f0_predictor=f0), seed)
    with torch.no_grad():
        f0.classifier.weight.mul_(60.0)
        f0.classifier.bias.fill_(100.0)
    return ref


def build(shape: dict, seed: int = 0) -> tuple[torch.nn.Module, HiFTGenerator]:
    ref = reference_generator(shape, seed)
    ours = HiFTGenerator(our_config(shape)).eval()
    load_weights(ours, hift_state(ref.state_dict()).items())  # strict: coverage both ways
    return ref, ours


def test_f0_predictor():
    ref = perturbed(f0_ref.ConvRNNF0Predictor(in_channels=12, cond_channels=COND))
    ours = F0Predictor(12, COND).eval()
    load_weights(ours, hift_state(ref.state_dict()).items())
    mel = torch.randn(2, 12, 30, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert peak_err(ours(mel), ref(mel)) <= 1e-6


def test_source_module_seeded():
    ref = perturbed(generator_ref.SourceModuleHnNSF2(24000, upsample_scale=24, harmonic_num=8, voiced_threshod=10))
    ours = HarmonicSource(24000, 24, harmonic_num=8, voiced_threshold=10).eval()
    load_weights(ours, ref.state_dict().items())
    f0 = random_f0(2, 10).repeat_interleave(24, dim=1).unsqueeze(-1)
    torch.manual_seed(7)
    with torch.no_grad():
        want, _, _ = ref(f0)
        got = ours(f0, generator=torch.Generator().manual_seed(7))
    assert peak_err(got, want) <= 1e-6


def test_per_sample_source_seeded():
    """The source Chatterbox's S3Gen uses at 24 kHz (CosyVoice1's at 22.05 kHz)."""
    ref = perturbed(generator_ref.SourceModuleHnNSF(24000, upsample_scale=24, harmonic_num=8, voiced_threshod=10))
    ours = HarmonicSource(24000, 24, harmonic_num=8, voiced_threshold=10, per_sample=True).eval()
    load_weights(ours, ref.state_dict().items())
    f0 = random_f0(2, 10).repeat_interleave(24, dim=1).unsqueeze(-1)
    torch.manual_seed(7)
    with torch.no_grad():
        want, _, _ = ref(f0)
        got = ours(f0, generator=torch.Generator().manual_seed(7))
        assert not torch.equal(got, ours(f0, generator=torch.Generator().manual_seed(8)))  # the draws matter
    assert peak_err(got, want) <= 1e-6


def test_snake_resblock():
    ref = perturbed(generator_ref.ResBlock(12, 5, [1, 3, 5]))
    ours = SnakeResBlock(12, 5, (1, 3, 5)).eval()
    load_weights(ours, hift_state(ref.state_dict()).items())
    x = torch.randn(2, 12, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert peak_err(ours(x), ref(x)) <= 1e-5


@pytest.mark.parametrize(("shape", "batch", "frames"),
                         [(TINY, 1, 14), (TINY, 2, 14), (COSYVOICE2_GEOMETRY, 1, 6), (PER_SAMPLE, 2, 14)],
                         ids=["tiny", "tiny-b2", "cosyvoice2", "per-sample-source"])
def test_generator_waveform(shape: dict, batch: int, frames: int):
    """The whole path: mel -> F0 -> seeded source -> waveform, against ``inference``."""
    ref, ours = build(shape)
    mel = torch.randn(batch, shape["in_channels"], frames, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.manual_seed(11)
        want, want_source = ref.inference(mel)
        got, got_source = ours(mel, generator=torch.Generator().manual_seed(11))
    samples = frames * our_config(shape).samples_per_frame
    assert got.shape == (batch, samples) and got_source.shape == (batch, 1, samples)
    assert peak_err(got_source, want_source) <= 1e-6
    err = peak_err(got, want)
    print(f"[hift parity] {shape['upsample_rates']} batch {batch}, {frames} frames: {err:.2e} of peak")
    assert err <= TOL


def test_decode_with_unvoiced_stretches_and_cached_source():
    """``decode`` from a given excitation (unvoiced stretches included), and the streaming
    path's ``cache_source`` splice, against the reference."""
    ref, ours = build(TINY, seed=1)
    g = torch.Generator().manual_seed(2)
    mel = torch.randn(1, TINY["in_channels"], 12, generator=g)
    with torch.no_grad():
        source = ours.excitation(random_f0(1, 12), generator=torch.Generator().manual_seed(4))
        assert peak_err(ours.decode(mel, source), ref.decode(mel, source)) <= TOL
        cache = 0.05 * torch.randn(1, 1, 100, generator=g)
        torch.manual_seed(11)
        want, want_source = ref.inference(mel, cache_source=cache)
        got, got_source = ours(mel, cache_source=cache, generator=torch.Generator().manual_seed(11))
    assert torch.equal(got_source[..., :100], cache)
    assert peak_err(got_source, want_source) <= 1e-6 and peak_err(got, want) <= TOL


def _old_weight_norm_names(state: dict) -> dict:
    """The pre-parametrization layout (``<m>.weight_g`` / ``<m>.weight_v``) that older torch
    wrote and released ``hift.pt`` files carry, under the GAN trainer's ``generator.`` prefix."""
    renamed = {}
    for name, tensor in state.items():
        name = name.replace("parametrizations.weight.original0", "weight_g")
        renamed["generator." + name.replace("parametrizations.weight.original1", "weight_v")] = tensor
    return renamed


def test_weights_from_the_released_key_layout():
    ref, _ = build(TINY)
    state = ref.state_dict()
    assert "conv_pre.parametrizations.weight.original0" in state  # the reference's own layout
    old = _old_weight_norm_names(state)
    assert "generator.conv_pre.weight_g" in old and "generator.f0_predictor.condnet.0.weight_v" in old
    ours = HiFTGenerator(our_config(TINY)).eval()
    load_weights(ours, hift_state(old).items())  # strict both ways
    folded = hift_state(state)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, folded[name]), name
    missing = dict(hift_state(old))
    del missing["source_resblocks.1.activations2.2.alpha"]
    with pytest.raises(WeightLoadError, match="activations2.2.alpha"):
        load_weights(HiFTGenerator(our_config(TINY)), missing.items())
    extra = dict(hift_state(old)) | {"f0_predictor.condnet.10.weight": torch.zeros(1)}
    with pytest.raises(WeightLoadError, match="condnet.10"):
        load_weights(HiFTGenerator(our_config(TINY)), extra.items())


def test_config_refuses_a_causal_per_sample_source():
    with pytest.raises(ValueError, match="per_sample_source"):
        HiFTConfig(causal=True, per_sample_source=True)
