"""Qwen3.5 image and video preprocessing: pictures in, flattened pixel patches and their
``(t, h, w)`` patch grids out, as the ViT tower (``mstar.model.qwen3_5.vision``) reads them.

The numbers follow transformers' processors for the checkpoint: images as the Qwen2-VL
image processor's PIL path (bicubic Pillow resize to a size chosen by ``smart_resize``,
rescale in float64 then normalise in float32, the frame repeated over the temporal patch);
videos as the Qwen3-VL video processor (frames sampled at the configured rate between
``min_frames`` and ``max_frames``, one resize for the clip chosen by the video
``smart_resize``, torch bicubic antialiased resize of uint8 frames, fused rescale and
normalise, the last frame repeated to fill a temporal patch). Settings come from the
checkpoint's ``preprocessor_config.json`` and ``video_preprocessor_config.json``.

Videos arrive decoded (a sequence of frames) or as the bytes of an animated image (GIF,
WebP, APNG), decoded with Pillow; no video container is decoded here.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageSequence

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the checkpoints' "resample"


class MediaError(ValueError):
    """Media the processor cannot take (undecodable, too large, too extreme an aspect ratio)."""


def _size_from(d: dict[str, Any], min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(min, max) pixels from a processor config: ``size`` edges, then ``min_pixels`` /
    ``max_pixels``, which take precedence as in transformers."""
    size = d.get("size") or {}
    low, high = size.get("shortest_edge", min_pixels), size.get("longest_edge", max_pixels)
    low = d["min_pixels"] if d.get("min_pixels") is not None else low
    high = d["max_pixels"] if d.get("max_pixels") is not None else high
    return int(low), int(high)


@dataclass(frozen=True)
class ImageProcessing:
    """Defaults are transformers' Qwen2-VL image processor's."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ImageProcessing:
        base = cls()
        low, high = _size_from(d, base.min_pixels, base.max_pixels)
        return cls(patch_size=int(d.get("patch_size", base.patch_size)),
                   temporal_patch_size=int(d.get("temporal_patch_size", base.temporal_patch_size)),
                   merge_size=int(d.get("merge_size", base.merge_size)), min_pixels=low, max_pixels=high,
                   image_mean=tuple(d.get("image_mean", base.image_mean)),
                   image_std=tuple(d.get("image_std", base.image_std)),
                   rescale_factor=float(d.get("rescale_factor", base.rescale_factor)))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoProcessing:
    """Defaults are transformers' Qwen3-VL video processor's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VideoProcessing:
        base = cls()
        low, high = _size_from(d, base.min_pixels, base.max_pixels)
        kwargs = {name: type(getattr(base, name))(d[name]) for name in
                  ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "fps", "min_frames",
                   "max_frames", "max_video_tokens") if d.get(name) is not None}
        return cls(min_pixels=low, max_pixels=high, image_mean=tuple(d.get("image_mean", base.image_mean)),
                   image_std=tuple(d.get("image_std", base.image_std)),
                   cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False), **kwargs)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass
class Media:
    """One processed image or video: ``patches [t*h*w, C*T*P*P]`` float32 and its grid.
    A video also has the timestamp (seconds) of each temporal group of frames."""

    kind: str  # "image" | "video"
    patches: torch.Tensor
    grid: tuple[int, int, int]
    timestamps: list[float] = field(default_factory=list)


@dataclass
class Video:
    """Decoded frames ``[T, H, W, 3]`` uint8 and their rate (None when unknown)."""

    frames: np.ndarray
    fps: float | None


# ------------------------------------------------------------------ sizes
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The image size nearest ``height x width`` with both sides multiples of ``factor`` and
    an area in ``[min_pixels, max_pixels]`` (aspect ratio kept as well as rounding allows)."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """As ``smart_resize``, with the budget over all frames (rounded to temporal patches)
    and tiny frames first scaled up to one ``factor``."""
    if num_frames < temporal_factor:
        raise MediaError(f"a video needs at least {temporal_factor} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        scale = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif t * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


# ----------------------------------------------------------------- images
def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: Image.Image, cfg: ImageProcessing) -> Media:
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    pixels = np.asarray(rgb.resize((width, height), resample=BICUBIC))  # [H, W, 3] uint8
    scaled = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean, std = np.array(cfg.image_mean, dtype=np.float32), np.array(cfg.image_std, dtype=np.float32)
    chw = ((scaled - mean) / std).transpose(2, 0, 1)
    patches, gh, gw = _patchify(torch.from_numpy(np.ascontiguousarray(chw))[None].expand(cfg.temporal_patch_size,
                                                                                          -1, -1, -1), cfg)
    return Media("image", patches, (1, gh, gw))


def _patchify(frames: torch.Tensor, cfg: ImageProcessing | VideoProcessing) -> tuple[torch.Tensor, int, int]:
    """``[T, C, H, W]`` (T a multiple of the temporal patch) -> ``[t*h*w, C*T*P*P]`` rows in
    frame-group, merge-block, patch order; and the patch grid's height and width."""
    frames_n, channels, height, width = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    x = frames.reshape(frames_n // tp, tp, channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, bh, bw, mh, mw, C, tp, ph, pw
    return x.reshape(-1, channels * tp * p * p).contiguous(), gh, gw


# ----------------------------------------------------------------- videos
def sample_indices(total: int, fps: float | None, cfg: VideoProcessing) -> np.ndarray:
    """Which of ``total`` frames to keep: ``cfg.fps`` per second of the source rate (24
    when unknown), clamped to ``[min_frames, max_frames]`` and to ``total``, spread evenly."""
    source_fps = 24.0 if fps is None else fps
    count = int(total / source_fps * cfg.fps)
    count = min(max(count, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(int)


def frame_timestamps(indices: Sequence[int], fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time."""
    fps = 24.0 if fps is None else fps
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def process_video(video: Video, cfg: VideoProcessing, *, sample: bool = True) -> Media:
    """Sample, resize, normalise and patch a decoded video."""
    total = video.frames.shape[0]
    indices = sample_indices(total, video.fps, cfg) if sample else np.arange(total)
    frames = torch.from_numpy(np.ascontiguousarray(video.frames[indices])).permute(0, 3, 1, 2)  # [T, 3, H, W]
    count, _, height, width = frames.shape
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * cfg.factor**2, cfg.max_pixels // count), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * count
    new_h, new_w = smart_resize_video(count, height, width, cfg.temporal_patch_size, cfg.factor, cfg.min_pixels,
                                      max_pixels)
    frames = resize_frames(frames, new_h, new_w)
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    frames = (frames.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    if pad := -count % cfg.temporal_patch_size:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
    patches, gh, gw = _patchify(frames, cfg)
    grid_t = frames.shape[0] // cfg.temporal_patch_size
    return Media("video", patches, (grid_t, gh, gw), frame_timestamps(indices, video.fps, cfg.temporal_patch_size))


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bicubic antialiased resize of uint8 ``[T, C, H, W]`` frames: native uint8 maths on the
    CPU, float maths rounded back to uint8 elsewhere (torchvision's resize does the same)."""
    if frames.shape[-2:] == (height, width):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def decode_animation(data: bytes, cfg: VideoProcessing, max_pixels: int | None = None) -> tuple[Video, np.ndarray]:
    """Decode the frames an animated image's sampling keeps (GIF, WebP, APNG, via Pillow).

    Returns the kept frames (as a video already sampled) and the sampled indices. The rate
    comes from the frames' durations. ``max_pixels`` caps kept frames x width x height."""
    try:
        image = Image.open(io.BytesIO(data))
        total = getattr(image, "n_frames", 1)
        durations = []
        for frame in ImageSequence.Iterator(image):
            durations.append(frame.info.get("duration") or 0)
    except Exception as err:  # Pillow raises many kinds for a bad file
        raise MediaError(f"cannot decode the video: {err}") from None
    fps = 1000.0 * total / sum(durations) if sum(durations) > 0 else None
    indices = sample_indices(total, fps, cfg)
    width, height = image.size
    if max_pixels is not None and len(indices) * width * height > max_pixels:
        raise MediaError(f"{len(indices)} sampled frames of {width}x{height} are "
                         f"{len(indices) * width * height} pixels, over max_video_pixels ({max_pixels})")
    frames = []
    try:
        for index in indices:
            image.seek(int(index))
            frames.append(np.asarray(to_rgb(image)))
    except Exception as err:
        raise MediaError(f"cannot decode frame of the video: {err}") from None
    return Video(np.stack(frames), fps), indices


def sampled_video(video: Video, indices: np.ndarray, cfg: VideoProcessing) -> Media:
    """``process_video`` for frames already sampled at ``indices`` of the source."""
    media = process_video(video, cfg, sample=False)
    media.timestamps = frame_timestamps(indices, video.fps, cfg.temporal_patch_size)
    return media


def frames_to_video(frames: Sequence[Any] | np.ndarray | torch.Tensor, fps: float | None) -> Video:
    """A video from a sequence of PIL images or ``[H, W, 3]`` uint8 arrays, or one
    ``[T, H, W, 3]`` uint8 array."""
    if isinstance(frames, torch.Tensor):
        frames = frames.numpy()
    if isinstance(frames, np.ndarray):
        array = frames
    else:
        if not frames:
            raise MediaError("a video needs at least one frame")
        array = np.stack([np.asarray(to_rgb(f)) if isinstance(f, Image.Image) else np.asarray(f) for f in frames])
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise MediaError(f"video frames must be [T, H, W, 3] uint8, got {list(array.shape)} {array.dtype}")
    return Video(array, fps)


def with_overrides(cfg, overrides: dict[str, Any], where: str):
    """``cfg`` with some fields replaced (deployment ``model_kwargs``); unknown names fail."""
    names = set(cfg.__dataclass_fields__)
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    return replace(cfg, **overrides)
