"""EarTTS's causal RVQ codec decoder: codes -> latent -> ConvNeXt upsampler -> inverse STFT.

The decoder (NeMo's ``Latent2Wav``) is causal: its transposed convolutions have kernel =
stride (each frame upsamples on its own), its 1x1 convolutions and channel LayerNorms act
per time step, and each ConvNeXt block's depthwise convolution looks back ``kernel_size - 1``
inputs. The inverse STFT's overlap-add leaves ``n_fft - hop_length`` samples of a chunk
pending for the next one. So a stream's whole state is a ``CodecState``: each block's last
``kernel_size - 1`` inputs and the pending overlap-add numerator and window envelope. A zeroed
state is the decoder's causal left padding, so decoding frame by frame from zeroed state
gives, concatenated, exactly the whole decode (the one-shot decode is that same walk with
every frame in one chunk).

The overlap-add's first ``(n_fft - hop_length) // 2`` samples are padding the reference
trims; the samples of a chunk are final once no later frame can add to them, so a stream's
first chunk yields ``ratio - pad`` samples, each later one ``ratio``, and ``flush`` the last
``pad`` (``pad`` is 6 for the released codec: 1758, 1764, ..., then 6).

Weights keep the checkpoint's names (``decoder.layers.<i>``, ``prvq.mus_list.<i>``); the
codec's encoder (only for a speaker-prompt recording) is not ported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.eartts.config import CodecConfig


class ChannelNorm(nn.Module):
    """LayerNorm over dim 1 of ``[B, C, T]`` (NeMo's ``LayerNormNd``)."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(1, keepdim=True)
        scaled = centred * torch.rsqrt(centred.pow(2).mean(1, keepdim=True) + self.eps)
        return scaled * self.weight[:, None] + self.bias[:, None]


class ConvNeXtBlock(nn.Module):
    """A causal ConvNeXt block; ``history`` holds its last ``kernel_size - 1`` inputs."""

    def __init__(self, dim: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.dwconv = nn.Conv1d(dim, dim, kernel_size, groups=dim)
        self.norm = ChannelNorm(dim)
        self.pwconv1 = nn.Conv1d(dim, 4 * dim, 1)
        self.pwconv2 = nn.Conv1d(4 * dim, dim, 1)

    def forward(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, C, T]`` after ``history [B, C, k-1]`` -> (output, the new history)."""
        padded = torch.cat([history.to(x.dtype), x], dim=2)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(self.dwconv(padded)))))
        return x + y, padded[:, :, -(self.kernel_size - 1):]


@dataclass
class CodecState:
    """One batch of streams' decoder state (rows = streams): ``conv[i]`` is ConvNeXt block
    ``i``'s last inputs ``[B, C_i, k-1]``, ``ola``/``env`` the pending overlap-add numerator
    and window envelope ``[B, n_fft - hop]``. All zeros: a stream that has decoded nothing."""

    conv: list[torch.Tensor]
    ola: torch.Tensor
    env: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv, self.ola, self.env]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> CodecState:
        return cls(list(tensors[:-2]), tensors[-2], tensors[-1])


class CodecDecoder(nn.Module):
    """Codes ``[B, T, Q]`` -> PCM, streamed through a ``CodecState``."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.prvq = _Codebooks(config)
        self.decoder = _Latent2Wav(config)

    def new_state(self, batch: int, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> CodecState:
        """Zeroed state for ``batch`` fresh streams (the overlap-add stays fp32)."""
        history = self.config.kernel_size - 1
        conv = [torch.zeros(batch, block.dwconv.in_channels, history, device=device, dtype=dtype)
                for block in self.decoder.blocks()]
        overlap = self.config.overlap
        zeros = torch.zeros(batch, overlap, device=device, dtype=torch.float32)
        return CodecState(conv, zeros, zeros.clone())

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Each per-stream state tensor's shape (a pool's slot)."""
        history = self.config.kernel_size - 1
        shapes = [(block.dwconv.in_channels, history) for block in self.decoder.blocks()]
        return [*shapes, (self.config.overlap,), (self.config.overlap,)]

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        return self.prvq.dequantize(codes)

    def step(self, codes: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor, CodecState]:
        """Decode ``codes [B, T, Q]`` after ``state``: (samples ``[B, T * ratio]``, each row's
        count of leading samples to drop (the padding, on a stream's first chunk), the new
        state). Rows are independent streams."""
        fresh = (state.env == 0).all(dim=1)
        latent = self.dequantize(codes)
        frames, conv = self.decoder.spectral_frames(latent, state.conv)
        out, ola, env = self.decoder.overlap_add(frames, state.ola, state.env)
        lead = torch.where(fresh, self.config.overlap // 2, 0)
        return out, lead, CodecState(conv, ola, env)

    def flush(self, state: CodecState) -> torch.Tensor:
        """A stream's last samples ``[B, (n_fft - hop) // 2]``, once it has no more frames."""
        half = self.config.overlap // 2
        env = state.env[:, :half]
        return torch.where(env > 0, state.ola[:, :half] / env.clamp(min=1e-11), 0.0)  # 0: nothing decoded

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole decode of ``codes [B, T, Q]``: ``[B, T * ratio]``."""
        state = self.new_state(codes.shape[0], device=codes.device, dtype=self.prvq.mus_list[0].dtype)
        out, lead, state = self.step(codes, state)
        return torch.cat([out[:, int(lead[0]):], self.flush(state)], dim=1)


class _Codebooks(nn.Module):
    """The residual codebooks (NeMo's ``PreTrainedProbabilisticVQ``, decode side)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.mus_list = nn.ParameterList(
            [nn.Parameter(torch.zeros(config.codebook_size, config.latent_size), requires_grad=False)
             for _ in range(config.num_quantizers)])

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        latent = F.embedding(codes[..., 0], self.mus_list[0])
        for i in range(1, len(self.mus_list)):
            latent = latent + F.embedding(codes[..., i], self.mus_list[i])
        return latent


class _Latent2Wav(nn.Module):
    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        width = config.latent_size
        for hidden, rate in zip(config.decoder_channels, reversed(config.rates), strict=True):
            layers.append(nn.ConvTranspose1d(width, hidden, rate, stride=rate, bias=False, groups=config.groups))
            layers.extend(ConvNeXtBlock(hidden, config.kernel_size) for _ in range(config.num_blocks))
            width = hidden
        layers.append(nn.Conv1d(width, config.n_fft + 2, 1, bias=False))
        self.layers = nn.ModuleList(layers)
        window = torch.hann_window(config.n_fft, dtype=torch.float32)  # float32 in a bf16 build too
        self.register_buffer("window", window, persistent=False)

    def blocks(self) -> list[ConvNeXtBlock]:
        return [layer for layer in self.layers if isinstance(layer, ConvNeXtBlock)]

    def spectral_frames(self, latent: torch.Tensor, history: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Latent ``[B, T, D]`` -> windowed inverse-FFT frames ``[B, n_fft, T * ratio / hop]``
        (fp32), and the blocks' new histories."""
        x = latent.transpose(1, 2)
        new_history: list[torch.Tensor] = []
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                x, kept = layer(x, history[len(new_history)])
                new_history.append(kept)
            else:
                x = layer(x)
        max_mag = 100.0
        mag, phase = x.float().chunk(2, dim=1)
        mag = max_mag * torch.exp(-F.softplus(math.log(max_mag) - mag))
        real = mag * torch.cos(phase)
        imag = mag[:, 1:-1] * torch.sin(phase[:, 1:-1])
        imag = F.pad(imag, (0, 0, 1, 1))  # DC and Nyquist are real
        frames = torch.fft.irfft(torch.complex(real, imag), n=self.config.n_fft, dim=1)
        window = self.window.float()[:, None]
        frames = torch.maximum(torch.minimum(frames, window), -window)  # constrain_value_range
        return frames * window, new_history

    def overlap_add(self, frames: torch.Tensor, ola: torch.Tensor, env: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Overlap-add ``frames [B, n_fft, N]`` after the pending ``ola``/``env``: the ``N * hop``
        finished samples, normalised by the window envelope, and the new pending tails."""
        n_fft, hop = self.config.n_fft, self.config.hop_length
        batch, _, count = frames.shape
        length = (count - 1) * hop + n_fft
        summed = F.fold(frames, output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop))[:, 0, 0]
        square = self.window.float().square()[None, :, None].expand(1, n_fft, count)
        envelope = F.fold(square, output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop))[:, 0, 0]
        overlap = n_fft - hop
        summed = torch.cat([summed[:, :overlap] + ola, summed[:, overlap:]], dim=1)
        envelope = torch.cat([envelope[:, :overlap] + env, envelope[:, overlap:].expand(batch, -1)], dim=1)
        done = count * hop
        return summed[:, :done] / envelope[:, :done], summed[:, done:], envelope[:, done:]
