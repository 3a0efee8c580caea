"""One-off cross-check of the causal HiFT against CosyVoice3's own ``CausalHiFTGenerator``.

CosyVoice3's code is not on PyPI (``cosyvoice-minicpmo`` is CosyVoice2's), so this is a
script, not a test: give it a checkout of github.com/FunAudioLLM/CosyVoice and run it with a
Python that has torch and scipy::

    PYTHONPATH=. python tests/model/hift_causal_crosscheck.py --cosyvoice /path/to/CosyVoice

It builds the reference at ``test_hift_causal.CAUSAL``'s tiny shape with perturbed random
weights, loads them into ours (weight norm folded, strict both ways), gives the reference our
position-indexed noise table in place of its own, and prints the waveform and source error
(of peak) for a whole decode and a streaming (``finalize=False``) decode. Last run
(2026-12-04, CosyVoice ace7c47, torch 2.13 CPU): 1.5e-6 (whole) and 1.3e-6 (streaming)
of peak.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_hift_causal import CAUSAL  # noqa: E402

from mstar.model.vocoder import HiFTGenerator, hift_state  # noqa: E402
from mstar.model.weights import load_weights  # noqa: E402
from tests.support.vocoder import peak_err  # noqa: E402


def reference(c=CAUSAL) -> torch.nn.Module:
    from cosyvoice.hifigan.f0_predictor import CausalConvRNNF0Predictor
    from cosyvoice.hifigan.generator import CausalHiFTGenerator

    torch.manual_seed(0)
    f0 = CausalConvRNNF0Predictor(in_channels=c.in_channels, cond_channels=c.f0_cond_channels)
    ref = CausalHiFTGenerator(
        in_channels=c.in_channels, base_channels=c.base_channels, nb_harmonics=c.nb_harmonics,
        sampling_rate=c.sampling_rate, upsample_rates=list(c.upsample_rates),
        upsample_kernel_sizes=list(c.upsample_kernel_sizes),
        istft_params={"n_fft": c.n_fft, "hop_len": c.hop_length},
        resblock_kernel_sizes=list(c.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in c.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(c.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in c.source_resblock_dilation_sizes],
        conv_pre_look_right=c.conv_pre_look_right, f0_predictor=f0,
    )
    g = torch.Generator().manual_seed(0)
    bins = c.n_fft // 2 + 1
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        f0.classifier.weight.mul_(60.0)
        f0.classifier.bias.fill_(100.0)
        ref.conv_post.parametrizations.weight.original0[:bins] *= 0.2  # the weight-norm magnitude
        ref.conv_post.bias[:bins] -= 3.0
    return ref.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cosyvoice", required=True, type=Path, help="a FunAudioLLM/CosyVoice checkout")
    args = parser.parse_args()
    sys.path.insert(0, str(args.cosyvoice))
    ref = reference()
    ours = HiFTGenerator(CAUSAL).eval()
    load_weights(ours, hift_state(ref.state_dict()).items())
    frames = 30
    mel = torch.randn(2, CAUSAL.in_channels, frames, generator=torch.Generator().manual_seed(1))
    table = torch.rand(1, frames * CAUSAL.samples_per_frame, CAUSAL.nb_harmonics + 1,
                       generator=torch.Generator().manual_seed(CAUSAL.noise_seed))
    ref.m_source.l_sin_gen.sine_waves = table  # the reference's fixed noise buffer, ours instead
    with torch.no_grad():
        for name, received, finalize in (("whole", frames, True), ("streaming", 22, False)):
            got, got_source = ours(mel[..., :received], finalize=finalize)
            want, want_source = ref.inference(mel[..., :received], finalize=finalize)
            print(f"{name}: waveform {peak_err(got, want):.2e} of peak ({tuple(got.shape)}), "
                  f"source {peak_err(got_source, want_source):.2e}")


if __name__ == "__main__":
    main()
