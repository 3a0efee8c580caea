"""The HiFT vocoder (HiFTNet: an NSF harmonic source feeding an iSTFTNet-style HiFi-GAN), as
CosyVoice2/3 and Chatterbox's S3Gen use it: mel frames ``[B, n_mels, T]`` -> 24 kHz audio.

The maths (CosyVoice's ``HiFTGenerator`` and ``ConvRNNF0Predictor``):

- the F0 predictor reads the mel: five ``kernel 3`` convolutions with ELU (``condnet``), a
  linear layer to one value per frame (``classifier``), absolute value -> F0 in Hz ``[B, T]``;
- F0 is repeated to the sample rate (nearest, ``prod(upsample_rates) * hop`` samples a frame)
  and turned into the harmonic excitation by the same hn-NSF source as Kokoro's
  (``HarmonicSource``: fundamental plus ``nb_harmonics`` overtones, phase summed on the frame
  grid, voiced above ``nsf_voiced_threshold``);
- the excitation's STFT, as real and imaginary parts (``n_fft + 2`` channels; Kokoro uses
  magnitude and phase), is brought to each upsampling stage's frame rate by ``source_downs[i]``
  (strided, kernel ``2u``, padding ``u // 2``; a 1x1 conv at the last stage) and shaped by a
  Snake residual block ``source_resblocks[i]``;
- the mel goes through ``conv_pre`` (kernel 7), then per stage: leaky ReLU (``lrelu_slope``),
  ``ups[i]``, a one-frame reflection pad on the left at the last stage, plus the source
  features, then the mean of the stage's Snake residual blocks (``resblocks``);
- leaky ReLU (0.01), ``conv_post`` to ``n_fft + 2`` channels: ``exp`` of the first half
  (capped at 100) is the magnitude, ``sin`` of the second half the phase; the iSTFT output is
  clamped to ``+-audio_limit``.

The residual blocks carry no style (unlike Kokoro's AdaIN blocks): Snake, dilated conv,
Snake, conv, residual, per dilation; Snake is ``x + sin(a x)^2 / (a + 1e-9)`` with a learned
per-channel ``a`` (``activations1.<j>.alpha``, shape ``[C]``).

The causal variant (``causal=True``, CosyVoice3's ``CausalHiFTGenerator``) keeps every
parameter name (not every shape: ``conv_pre``'s and the F0 predictor's first kernels differ,
and ``ups[i]`` are plain convs) and looks only backwards, except for a bounded look-ahead: the F0
predictor's first conv (kernel 4) reads 3 frames ahead, ``conv_pre`` (kernel
``conv_pre_look_right + 1``) reads ``conv_pre_look_right`` ahead; every other conv pads on the
left only; ``ups[i]`` repeat each frame ``rate`` times and then convolve (no transposed conv);
the source's phase is upsampled by repetition and its noise is a fixed table indexed by
sample position (uniform draws, as the reference's ``torch.rand`` table; drawn on the CPU from
``noise_seed``). Streaming reruns the whole mel so far with ``finalize=False``: the
look-ahead frames feed the convs as context instead of zeros, and the output stops one mel
frame before the iSTFT would need frames not yet seen; each call's output is a prefix of the
whole-utterance decode (``tests/model/test_hift_causal.py``). As in the reference, the
causal F0 predictor runs in float64.

Which sine source: CosyVoice2/3 sum the phase on the frame grid (``SineGen``, the default);
Chatterbox's S3Gen (at 24 kHz) and CosyVoice1 (22.05 kHz) sum it per sample
(``per_sample_source=True``, ``SampleSineGen``). The reference code picks by sampling rate
(22050 -> per sample) in CosyVoice and always per sample in Chatterbox; here it is explicit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.vocoder.istft import ISTFT
from mstar.model.vocoder.nsf import HarmonicSource
from mstar.model.vocoder.weight_norm import fold_weight_norm

__all__ = ["F0Predictor", "HiFTConfig", "HiFTGenerator", "PaddedConv1d", "SnakeResBlock", "hift_state"]

_MAX_MAGNITUDE = 100.0


def _same_padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


@dataclass(frozen=True)
class HiFTConfig:
    """The generator's shape: CosyVoice2's ``hift`` block of its ``cosyvoice2.yaml`` (the
    defaults are CosyVoice2-0.5B's), plus the F0 predictor's width."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_length: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512
    causal: bool = False
    conv_pre_look_right: int = 4
    """Causal only: mel frames ``conv_pre`` reads ahead (CosyVoice3: 4)."""
    noise_seed: int = 0
    """Causal only: the seed of the position-indexed source noise table."""
    per_sample_source: bool = False
    """Sum the source's phase per sample (Chatterbox's S3Gen, CosyVoice1), not per frame."""

    def __post_init__(self) -> None:
        stages = len(self.upsample_rates)
        if len(self.upsample_kernel_sizes) != stages:
            raise ValueError("upsample_rates and upsample_kernel_sizes must have the same length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have the same length")
        if not len(self.source_resblock_kernel_sizes) == len(self.source_resblock_dilation_sizes) == stages:
            raise ValueError("source_resblock_kernel_sizes/dilation_sizes need one entry per upsampling stage")
        if self.causal and self.per_sample_source:
            raise ValueError("the causal HiFT sums its source's phase per frame: per_sample_source must be False")

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per mel frame (and per F0 value)."""
        return math.prod(self.upsample_rates) * self.hop_length


class PaddedConv1d(nn.Conv1d):
    """A conv that pads itself: ``upsample``-fold frame repetition first (if > 1), then
    ``left`` zeros and ``right`` frames (zeros, or the real ``lookahead`` frames a streaming
    caller passes). Parameter names are ``nn.Conv1d``'s."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        stride: int = 1,
        dilation: int = 1,
        left: int = 0,
        right: int = 0,
        upsample: int = 1,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation)
        self.left, self.right, self.upsample = left, right, upsample

    def forward(self, x: torch.Tensor, lookahead: torch.Tensor | None = None) -> torch.Tensor:
        if self.upsample > 1:
            x = x.repeat_interleave(self.upsample, dim=-1)
        if lookahead is None:
            x = F.pad(x, (self.left, self.right))
        else:
            if lookahead.shape[-1] != self.right:
                raise ValueError(f"lookahead has {lookahead.shape[-1]} frames, the conv reads {self.right} ahead")
            x = torch.cat([F.pad(x, (self.left, 0)), lookahead], dim=-1)
        return super().forward(x)


def _conv(channels_in: int, channels: int, kernel: int, dilation: int, causal: bool) -> nn.Conv1d:
    """A stride-1 conv keeping the length: centred, or causal (all padding on the left)."""
    if causal:
        return PaddedConv1d(channels_in, channels, kernel, dilation=dilation, left=(kernel - 1) * dilation)
    return nn.Conv1d(channels_in, channels, kernel, dilation=dilation, padding=_same_padding(kernel, dilation))


class SnakeResBlock(nn.Module):
    """HiFi-GAN/BigVGAN residual block with Snake activations, one pair of convs per dilation."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], causal: bool = False) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(_conv(channels, channels, kernel_size, d, causal) for d in dilations)
        self.convs2 = nn.ModuleList(_conv(channels, channels, kernel_size, 1, causal) for _ in dilations)
        self.activations1 = nn.ModuleList(_Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(_Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class _Snake(nn.Module):
    """``x + sin(a x)^2 / (a + 1e-9)``, ``a`` per channel (the checkpoint's ``alpha``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[:, None]
        return x + torch.sin(alpha * x) ** 2 / (alpha + 1e-9)


class F0Predictor(nn.Module):
    """Mel ``[B, in_channels, T]`` -> F0 in Hz ``[B, T]`` (CosyVoice's ``ConvRNNF0Predictor``;
    despite the name, convolutions only). ``condnet.<2i>`` are the convs, ELU between. Causal
    (CosyVoice3): the first conv has kernel 4 and reads ``lookahead`` = 3 frames ahead, the
    others read only back."""

    lookahead = 3

    def __init__(self, in_channels: int, cond_channels: int, layers: int = 5, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        convs: list[nn.Module] = []
        for i in range(layers):
            width = in_channels if i == 0 else cond_channels
            if causal and i == 0:
                conv: nn.Module = PaddedConv1d(width, cond_channels, self.lookahead + 1, right=self.lookahead)
            else:
                conv = _conv(width, cond_channels, 3, 1, causal)
            convs += [conv, nn.ELU()]
        self.condnet = nn.Sequential(*convs)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """``finalize=False`` (causal, streaming): the last ``lookahead`` frames are context
        only, and F0 comes back for the frames before them."""
        if finalize:
            x = self.condnet(mel)
        else:
            cut = mel.shape[-1] - self.lookahead
            x = self.condnet[1:](self.condnet[0](mel[..., :cut], mel[..., cut:]))
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class HiFTGenerator(nn.Module):
    """Mel ``[B, in_channels, T]`` -> waveform ``[B, T * samples_per_frame]`` and the harmonic
    excitation ``[B, 1, T * samples_per_frame]`` it was made from."""

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.f0_predictor = F0Predictor(c.in_channels, c.f0_cond_channels, causal=c.causal)
        self.m_source = HarmonicSource(
            c.sampling_rate,
            c.samples_per_frame,
            c.nb_harmonics,
            c.nsf_alpha,
            c.nsf_sigma,
            c.nsf_voiced_threshold,
            causal=c.causal,
            per_sample=c.per_sample_source,
        )
        self.stft = ISTFT(c.n_fft, c.hop_length)
        source_channels = c.n_fft + 2
        if c.causal:
            look = c.conv_pre_look_right
            self.conv_pre: nn.Conv1d = PaddedConv1d(c.in_channels, c.base_channels, look + 1, right=look)
        else:
            self.conv_pre = nn.Conv1d(c.in_channels, c.base_channels, 7, padding=3)
        self.ups = nn.ModuleList()
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)):
            ch_in, ch = c.base_channels // 2**i, c.base_channels // 2 ** (i + 1)
            stride = math.prod(c.upsample_rates[i + 1 :])  # source frames per this stage's frame
            if c.causal:
                self.ups.append(PaddedConv1d(ch_in, ch, kernel, left=kernel - 1, upsample=rate))
                down = PaddedConv1d(source_channels, ch, 2 * stride, stride=stride, left=stride - 1)
            else:
                self.ups.append(nn.ConvTranspose1d(ch_in, ch, kernel, rate, padding=(kernel - rate) // 2))
                down = nn.Conv1d(source_channels, ch, 2 * stride, stride, padding=stride // 2)
            self.source_downs.append(nn.Conv1d(source_channels, ch, 1) if stride == 1 else down)
            self.source_resblocks.append(SnakeResBlock(
                ch, c.source_resblock_kernel_sizes[i], tuple(c.source_resblock_dilation_sizes[i]), c.causal
            ))
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes):
                self.resblocks.append(SnakeResBlock(ch, k, tuple(d), c.causal))
        self.conv_post = _conv(c.base_channels // 2 ** len(c.upsample_rates), source_channels, 7, 1, c.causal)

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """F0 ``[B, T]`` from the mel. Causal: computed in float64, as the reference does: the
        source sums F0 into a phase over the whole utterance, and float32 rounding that
        differs with the input's length (conv kernels pick blockings by size) would make a
        partial decode drift from the whole one."""
        if not self.config.causal:
            return self.f0_predictor(mel, finalize)
        wide = {name: p.double() for name, p in self.f0_predictor.named_parameters()}
        return torch.func.functional_call(self.f0_predictor, wide, (mel.double(), finalize)).to(mel.dtype)

    def excitation(
        self, f0: torch.Tensor, *, noise: bool = True, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """F0 ``[B, T]`` -> the harmonic source ``[B, 1, T * samples_per_frame]``. Causal: the
        noise is the position-indexed table (``generator`` is not used)."""
        c = self.config
        f0 = F.interpolate(f0[:, None], scale_factor=c.samples_per_frame, mode="nearest").transpose(1, 2)
        table = None
        if c.causal and noise:
            # torch's CPU uniform draws run element by element, so a shorter table is a prefix
            # of a longer one: no need to hold the reference's 300-second buffer.
            seeded = torch.Generator().manual_seed(c.noise_seed)
            table = torch.rand(1, f0.shape[1], c.nb_harmonics + 1, generator=seeded).to(f0.device)
        return self.m_source(f0, noise=noise, generator=generator, noise_table=table).transpose(1, 2)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Mel ``[B, in_channels, T]`` and the excitation ``[B, 1, L]`` -> waveform ``[B, L]``.
        ``finalize=False`` (causal streaming): the last ``conv_pre_look_right`` mel frames are
        context only, and the waveform stops one more frame short (the iSTFT's overlap-add of
        the last frame needs the next); the source may run past the kept frames."""
        c = self.config
        real, imag = self.stft.analyse_complex(source.squeeze(1))
        source_spec = torch.cat([real, imag], dim=1)
        if finalize:
            x = self.conv_pre(mel)
        else:
            if not c.causal:
                raise ValueError("finalize=False streams the causal HiFT only")
            cut = mel.shape[-1] - c.conv_pre_look_right
            x = self.conv_pre(mel[..., :cut], mel[..., cut:])
            source_spec = source_spec[..., : cut * math.prod(c.upsample_rates) + 1]
        kernels = len(c.resblock_kernel_sizes)
        stages = len(self.ups)
        for i, (up, down, shape_source) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks)):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + shape_source(down(source_spec))
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x))
        bins = self.stft.bins
        wave = self.stft.synthesise(torch.exp(x[:, :bins]), torch.sin(x[:, bins:]), max_magnitude=_MAX_MAGNITUDE)
        if not finalize:
            wave = wave[..., : -c.samples_per_frame]
        return wave.squeeze(1).clamp(-c.audio_limit, c.audio_limit)

    def forward(
        self,
        mel: torch.Tensor,
        *,
        cache_source: torch.Tensor | None = None,
        finalize: bool = True,
        noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mel -> (waveform ``[B, L]``, excitation ``[B, 1, L]``). ``cache_source`` (the
        excitation a previous call returned for the overlapping head of this mel) replaces the
        head of the new excitation, as CosyVoice2's streaming does to avoid a phase glitch.

        Causal streaming (CosyVoice3) passes the whole mel so far with ``finalize=False``: the
        waveform then covers ``T - 3 - conv_pre_look_right - 1`` frames and is a prefix of what
        the finished utterance decodes to; the last call passes ``finalize=True``."""
        if not finalize and not self.config.causal:
            raise ValueError("finalize=False streams the causal HiFT only")
        source = self.excitation(self.predict_f0(mel, finalize), noise=noise, generator=generator)
        if cache_source is not None and cache_source.shape[-1]:
            source = torch.cat([cache_source, source[..., cache_source.shape[-1] :]], dim=-1)
        if not finalize:
            mel = mel[..., : -self.f0_predictor.lookahead]
        return self.decode(mel, source, finalize), source


def hift_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A released ``hift.pt`` state dict as ``HiFTGenerator`` names it: the ``generator.``
    prefix of checkpoints saved from the GAN trainer dropped (CosyVoice's loader does the same)
    and weight-norm pairs (``weight_g``/``weight_v`` or parametrization names) folded."""
    return fold_weight_norm({name.removeprefix("generator."): tensor for name, tensor in state.items()})
