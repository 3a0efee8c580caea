"""CAM++ (CAMPPlus), the speaker x-vector network of 3D-Speaker that CosyVoice and
Chatterbox's S3Gen condition on: 16 kHz speech -> one 192-d speaker embedding.

The maths, per clip:

- features: 80-bin Kaldi fbank (``kaldi_fbank``), minus their mean over the clip's frames;
- ``head`` (FCM): the fbank as a one-channel image ``[1, 80, T]``, a 3x3 conv, two stages of
  two 2-D residual blocks (each stage halves the frequency axis), a 3x3 conv halving it once
  more, flattened to ``32 * 10`` channels over time;
- ``xvector``: a ``kernel 5, stride 2`` TDNN to ``init_channels``; three densely connected
  blocks of 12, 24 and 16 CAM layers (dilations 1, 2, 2), each layer appending
  ``growth_rate`` channels: BN-ReLU, 1x1 conv to ``bn_size * growth_rate``, BN-ReLU, then a
  dilated ``kernel 3`` conv gated by a sigmoid of context (the clip mean plus the mean of its
  100-frame segment, through a two-layer bottleneck); a transition (BN-ReLU, 1x1 conv
  halving the channels) after each block; BN-ReLU; mean and unbiased standard deviation
  over time; a 1x1 layer to ``embedding_size`` with a non-affine BatchNorm.

Every BatchNorm runs on its stored statistics (inference). Parameter names are the
reference's (``head.layer1.0.conv1.weight``, ``xvector.block1.tdnnd1.cam_layer.linear1.bias``,
``xvector.dense.nonlinear.batchnorm.running_mean``, ...); Chatterbox's ``s3gen.safetensors``
stores them under ``speaker_encoder.`` (``campplus_name_map``).

Clips are embedded one at a time: the reference's batched path pads shorter clips' features
with zeros that then enter their statistics pooling, so only its single-clip path (the one
Chatterbox and CosyVoice take) is a property of the clip.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.speech_front.fbank import kaldi_fbank


@dataclass(frozen=True)
class CampPlusConfig:
    """The network's widths. Defaults are the released model (3D-Speaker's CAM++ as S3Gen and
    CosyVoice ship it)."""

    feat_dim: int = 80
    embedding_size: int = 192
    growth_rate: int = 32
    bn_size: int = 4
    init_channels: int = 128
    head_channels: int = 32
    block_layers: tuple[int, ...] = (12, 24, 16)
    block_dilations: tuple[int, ...] = (1, 2, 2)
    segment_frames: int = 100  # the CAM layers' local context


class BnRelu(nn.Module):
    """BatchNorm then ReLU; named ``batchnorm`` as the checkpoint's ``nonlinear.batchnorm``."""

    def __init__(self, channels: int, affine: bool = True, relu: bool = True) -> None:
        super().__init__()
        self.batchnorm = nn.BatchNorm1d(channels, affine=affine)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.batchnorm(x)
        return F.relu(x) if self.relu else x


# ----------------------------------------------------------------------------- head
class ResBlock2d(nn.Module):
    """Two 3x3 convs with BatchNorm; the first strides the frequency axis; a 1x1 projection
    on the shortcut when the shape changes."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class FCMHead(nn.Module):
    """The 2-D front: ``[B, feat_dim, T]`` -> ``[B, channels * feat_dim / 8, T]``."""

    def __init__(self, channels: int, feat_dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1))
        self.layer2 = nn.Sequential(ResBlock2d(channels, channels, 2), ResBlock2d(channels, channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (feat_dim // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x[:, None])))
        out = self.layer2(self.layer1(out))
        out = F.relu(self.bn2(self.conv2(out)))
        return out.flatten(1, 2)


# ----------------------------------------------------------------------------- x-vector
class TDNN(nn.Module):
    """A strided conv (no bias) then BN-ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.nonlinear = BnRelu(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """A dilated conv whose output channels are gated by the clip's and the local segment's
    mean (context-aware masking)."""

    def __init__(self, channels: int, out_channels: int, dilation: int, segment_frames: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(channels, out_channels, 3, padding=dilation, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, out_channels, 1)
        self.segment_frames = segment_frames

    def segment_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Each frame's mean over its ``segment_frames``-long segment (the last may be shorter)."""
        seg = F.avg_pool1d(x, self.segment_frames, self.segment_frames, ceil_mode=True)
        return seg.repeat_interleave(self.segment_frames, dim=-1)[..., : x.shape[-1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.mean(-1, keepdim=True) + self.segment_mean(x)
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.linear_local(x) * gate


class CAMDenseLayer(nn.Module):
    """BN-ReLU, 1x1 bottleneck, BN-ReLU, CAM layer: the ``growth_rate`` new channels."""

    def __init__(self, in_channels: int, config: CampPlusConfig, dilation: int) -> None:
        super().__init__()
        bottleneck = config.bn_size * config.growth_rate
        self.nonlinear1 = BnRelu(in_channels)
        self.linear1 = nn.Conv1d(in_channels, bottleneck, 1, bias=False)
        self.nonlinear2 = BnRelu(bottleneck)
        self.cam_layer = CAMLayer(bottleneck, config.growth_rate, dilation, config.segment_frames)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseBlock(nn.ModuleDict):
    """Dense connectivity: each layer (``tdnnd1``, ``tdnnd2``, ...) reads every channel so far
    and appends its own."""

    def __init__(self, layers: int, in_channels: int, config: CampPlusConfig, dilation: int) -> None:
        super().__init__({
            f"tdnnd{i + 1}": CAMDenseLayer(in_channels + i * config.growth_rate, config, dilation)
            for i in range(layers)
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = torch.cat((x, layer(x)), dim=1)
        return x


class Transit(nn.Module):
    """BN-ReLU then a 1x1 conv (no bias) between dense blocks."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.nonlinear = BnRelu(in_channels)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x))


class StatsPool(nn.Module):
    """Mean and unbiased standard deviation over time, concatenated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x.mean(-1), x.std(-1, unbiased=True)), dim=-1)


class Dense(nn.Module):
    """The embedding layer: a 1x1 map (no bias) then a non-affine BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.nonlinear = BnRelu(out_channels, affine=False, relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x[..., None]))[..., 0]


def _xvector(in_channels: int, config: CampPlusConfig) -> nn.Sequential:
    stages: OrderedDict[str, nn.Module] = OrderedDict()
    stages["tdnn"] = TDNN(in_channels, config.init_channels, 5, stride=2)
    channels = config.init_channels
    for i, (layers, dilation) in enumerate(zip(config.block_layers, config.block_dilations, strict=True)):
        stages[f"block{i + 1}"] = CAMDenseBlock(layers, channels, config, dilation)
        channels += layers * config.growth_rate
        stages[f"transit{i + 1}"] = Transit(channels, channels // 2)
        channels //= 2
    stages["out_nonlinear"] = BnRelu(channels)
    stages["stats"] = StatsPool()
    stages["dense"] = Dense(2 * channels, config.embedding_size)
    return nn.Sequential(stages)


class CampPlus(nn.Module):
    """16 kHz clips -> speaker x-vectors ``[B, embedding_size]``.

    ``CampPlus(config)(clips)`` takes a list of ``[num_samples]`` tensors (or a ``[B, num_samples]``
    tensor) and embeds each clip on its own (see the module docstring); ``forward_features``
    runs the network on mean-normalised fbank ``[B, T, feat_dim]``.
    """

    def __init__(self, config: CampPlusConfig | None = None) -> None:
        super().__init__()
        self.config = config or CampPlusConfig()
        self.head = FCMHead(self.config.head_channels, self.config.feat_dim)
        self.xvector = _xvector(self.head.out_channels, self.config)

    def features(self, clip: torch.Tensor) -> torch.Tensor:
        """Mean-normalised Kaldi fbank ``[T, feat_dim]`` of one clip (at least 3 frames, 45 ms:
        the pooled standard deviation needs two frames after the strided TDNN)."""
        fbank = kaldi_fbank(torch.as_tensor(clip), self.config.feat_dim)
        if fbank.shape[0] < 3:
            raise ValueError(f"a clip of {clip.shape[-1]} samples is too short for a speaker x-vector (45 ms)")
        return fbank - fbank.mean(dim=0, keepdim=True)

    def forward_features(self, feats: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, embedding_size]`` of fbank ``[B, T, feat_dim]`` (in the weights' dtype)."""
        feats = feats.to(self.head.conv1.weight.dtype)
        return self.xvector(self.head(feats.transpose(1, 2)))

    @torch.no_grad()
    def forward(self, clips: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        device = self.head.conv1.weight.device
        feats = [self.features(torch.as_tensor(clip).to(device)) for clip in clips]
        return torch.cat([self.forward_features(f[None]) for f in feats])


def campplus_name_map(prefix: str = "speaker_encoder.") -> Callable[[str], str | None]:
    """A ``load_weights`` name map taking the tensors under ``prefix`` (Chatterbox's
    ``s3gen.safetensors``; ``""`` for a bare CAM++ state dict) and skipping the rest."""

    def rename(name: str) -> str | None:
        return name[len(prefix):] if name.startswith(prefix) else None

    return rename
