"""The base checkpoints' speaker encoder (ECAPA-TDNN): a 24 kHz clip to the x-vector the talker
takes in place of a built-in speaker's codec row.

Front end: 128-bin log-mel frames of the clip (1024-sample Hann windows every 256 samples,
0 to 12 kHz, the Slaney filterbank; ``mstar.model.s3gen.mel.log_mel``'s maths with these
settings). Then a TDNN layer, SE-Res2Net blocks (a 1x1 TDNN, the Res2Net split where each
slice after the first runs a dilated TDNN on itself plus the previous slice's output, a 1x1
TDNN, squeeze-excitation gating, a residual), the blocks' outputs concatenated through a
multi-layer aggregation TDNN (``mfa``), attentive statistics pooling (a weighted mean and
standard deviation per channel, the weights from the frames and the global statistics) and a
1x1 conv to ``enc_dim``. Every conv pads "same" by reflection, as the reference's do.

Parameter names are the released ``speaker_encoder.`` keys less that prefix.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.qwen3_tts.config import SpeakerEncoderConfig
from mstar.model.s3gen.mel import MelConfig, log_mel

MEL = MelConfig(sampling_rate=24000, n_fft=1024, hop=256, n_mels=128, fmin=0.0, fmax=12000.0)


def same_conv(channels_in: int, channels_out: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(channels_in, channels_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """``relu(conv(x))``."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = same_conv(channels_in, channels_out, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out, previous = [parts[0]], None
        for block, part in zip(self.blocks, parts[1:]):
            previous = block(part if previous is None else part + previous)
            out.append(previous)
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, inner: int) -> None:
        super().__init__()
        self.conv1 = same_conv(channels, inner)
        self.conv2 = same_conv(inner, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, scale: int, se_channels: int, kernel: int,
                 dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(channels_in, channels, 1, 1)
        self.res2net_block = Res2Net(channels, scale, kernel, dilation)
        self.tdnn2 = TDNN(channels, channels, 1, 1)
        self.se_block = SqueezeExcitation(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class AttentiveStatisticsPooling(nn.Module):
    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = same_conv(attention_channels, channels)

    @staticmethod
    def statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(dim=2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(dim=2).clamp(min=1e-12))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        mean, std = self.statistics(x, torch.full_like(x[:, :1], 1.0 / frames))
        context = torch.cat([x, mean[..., None].expand(-1, -1, frames), std[..., None].expand(-1, -1, frames)], 1)
        weights = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = self.statistics(x, weights)
        return torch.cat([mean, std], dim=1)[..., None]


class Qwen3TTSSpeakerEncoder(nn.Module):
    """Log-mel frames ``[B, T, mel_dim]`` to x-vectors ``[B, enc_dim]``."""

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        c = config
        if not len(c.enc_channels) == len(c.enc_kernel_sizes) == len(c.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have one entry per layer")
        self.config = config
        blocks: list[nn.Module] = [TDNN(c.mel_dim, c.enc_channels[0], c.enc_kernel_sizes[0], c.enc_dilations[0])]
        blocks += [SERes2NetBlock(c.enc_channels[i - 1], c.enc_channels[i], c.enc_res2net_scale, c.enc_se_channels,
                                  c.enc_kernel_sizes[i], c.enc_dilations[i]) for i in range(1, len(c.enc_channels) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(c.enc_channels[-1], c.enc_channels[-1], c.enc_kernel_sizes[-1], c.enc_dilations[-1])
        self.asp = AttentiveStatisticsPooling(c.enc_channels[-1], c.enc_attention_channels)
        self.fc = same_conv(c.enc_channels[-1] * 2, c.enc_dim)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x, outs = mels.transpose(1, 2), []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]

    @torch.inference_mode()
    def embed_clip(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The x-vector ``[enc_dim]`` of a mono clip at 24 kHz (float samples in ``[-1, 1]``)."""
        weight = self.fc.weight
        wave = torch.as_tensor(samples, dtype=torch.float32).reshape(-1).to(weight.device)
        mels = log_mel(wave[None], MEL).transpose(1, 2)
        return self(mels.to(weight.dtype))[0]
