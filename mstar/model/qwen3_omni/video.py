"""Qwen3-Omni's video preprocessing: a container's bytes (mp4, webm, mkv, ...: whatever PyAV's
FFmpeg reads) in, flattened pixel patches, the ``(t, h, w)`` patch grid and the seconds per
temporal group out.

The rules are transformers' for the checkpoint (its ``Qwen2VLVideoProcessor`` with the Omni
processor's settings): ``fps`` frames a second of the source are kept, at least
``min_frames``, at most ``max_frames`` and the source's count, rounded down to whole temporal
patches, spread by ``arange(0, total, total / n)``; every frame gets the size ``smart_resize``
picks for one frame (sides multiples of ``patch * merge``, area in ``[min_pixels,
max_pixels]``), a bicubic antialiased resize, the fused rescale and normalise, and the patch
layout of images (``mstar.model.qwen3_5.processor``, whose pieces this reuses). A temporal
group spans ``temporal_patch_size / fps`` seconds: the processor's ``video_second_per_grid``
when it is given the sampling rate.

``read_soundtrack`` gives the container's audio for ``use_audio_in_video``: mono, resampled
to the audio tower's 16 kHz as uploaded audio is (``mstar.audio.io.resample``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mstar.media.video import VideoDecodeError, decode_frames, decode_soundtrack, probe_video
from mstar.model.qwen3_5.processor import (
    Media,
    MediaError,
    VideoProcessing,
    _patchify,
    resize_frames,
    smart_resize,
)


def video_settings(d: dict[str, Any], **fixed: Any) -> VideoProcessing:
    """Qwen3.5's video settings (``VideoProcessing``: sizes, mean and std, frame bounds, 2 frames a
    second) from a ``video_preprocessor_config.json`` (or ``preprocessor_config.json``) dict;
    ``fixed`` (the tower's patch sizes, the deployment's knobs) wins over it."""
    return replace(VideoProcessing.from_hf_dict(d), **fixed)


def seconds_per_grid(cfg: VideoProcessing) -> float:
    """Seconds one temporal group of patches spans."""
    return cfg.temporal_patch_size / cfg.fps


@dataclass
class VideoClip:
    media: Media  # kind "video": patches [t*h*w, C*T*P*P] and the grid
    seconds_per_grid: float
    audio: Any = None  # the soundtrack's prompt.Clip, for use_audio_in_video


def sample_indices(total: int, source_fps: float | None, cfg: VideoProcessing) -> list[int]:
    """The kept frames of ``total`` at ``source_fps`` (24 when the container gives none)."""
    tp = cfg.temporal_patch_size
    most = min(cfg.max_frames, total) // tp * tp
    count = total / (source_fps or 24.0) * cfg.fps
    count = int(min(max(count, cfg.min_frames), most, total) // tp * tp)
    if count < tp:
        raise MediaError(f"a video needs at least {tp} frames, got {total}")
    return torch.arange(0, total, total / count).int().tolist()


def process_frames(frames: np.ndarray, cfg: VideoProcessing) -> Media:
    """``uint8 [T, H, W, 3]`` sampled frames -> the tower's patches and grid."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, 3, H, W]
    count, _, height, width = video.shape
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    video = resize_frames(video, new_h, new_w)
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    video = (video.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    if pad := -count % cfg.temporal_patch_size:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
    patches, gh, gw = _patchify(video, cfg)
    return Media("video", patches, (video.shape[0] // cfg.temporal_patch_size, gh, gw))


def read_video(data: bytes, cfg: VideoProcessing, max_pixels: int) -> VideoClip:
    """Probe, sample, decode only the kept frames, and process them. ``max_pixels`` caps the
    kept frames x source width x height, checked before any frame is decoded."""
    try:
        total, fps, width, height = probe_video(data)
        indices = sample_indices(total, fps, cfg)
        if len(indices) * width * height > max_pixels:
            raise MediaError(f"{len(indices)} sampled frames of {width}x{height} are {len(indices) * width * height}"
                             f" pixels, over max_video_pixels ({max_pixels})")
        frames = decode_frames(data, indices)
    except VideoDecodeError as err:
        raise MediaError(str(err)) from None
    return VideoClip(process_frames(frames, cfg), seconds_per_grid(cfg))


def read_soundtrack(data: bytes, rate: int, max_seconds: float) -> np.ndarray:
    """The container's first audio stream, mono float32 at ``rate``; refused (``MediaError``)
    when it has none, is empty, or is over ``max_seconds``."""
    from mstar.audio.io import resample

    try:
        track = decode_soundtrack(data)
    except VideoDecodeError as err:
        raise MediaError(str(err)) from None
    if track is None or not track[0].size:
        raise MediaError("use_audio_in_video needs a video with an audio track; this one has none")
    samples, source_rate = track
    if samples.size / source_rate > max_seconds:
        raise MediaError(f"the video's audio is {samples.size / source_rate:.1f} s, over max_audio_seconds "
                         f"({max_seconds:g})")
    return resample(samples, source_rate, rate).astype(np.float32)
