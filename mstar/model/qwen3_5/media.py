"""A chat request's images and videos, taken out of its messages for the processor.

The server hands each message's content as a string or a list of parts:
``{"type": "text", "text": str}``, ``{"type": "image", "data": bytes | PIL.Image}`` or
``{"type": "video", "data": bytes | frames, "fps": float (optional)}``, where a video's
bytes are an animated image (GIF, WebP, APNG) and its frames a sequence of PIL images or
``[H, W, 3]`` uint8 arrays (or one ``[T, H, W, 3]`` array). The chat template sees the
parts as ``{"type": "text" | "image" | "video"}``, so it writes one placeholder per media
where the client put it. Budgets are checked before anything large is decoded; a part the
rules refuse raises ``RequestError`` naming ``messages[i].content[j]``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from mstar.contract import RequestError
from mstar.model.chat import split_content
from mstar.model.qwen3_5.processor import (
    ImageProcessing,
    Media,
    MediaError,
    VideoProcessing,
    decode_animation,
    frames_to_video,
    process_image,
    process_video,
    sample_indices,
    sampled_video,
)


@dataclass(frozen=True)
class MediaLimits:
    """``max_image_pixels``: width x height of one decoded image. ``max_video_pixels``: the
    sampled frames' count x width x height of one video. ``max_media``: media per request."""

    max_image_pixels: int = 1 << 26
    max_video_pixels: int = 1 << 30
    max_media: int = 64


def split_media(messages: list[dict], limits: MediaLimits, images: ImageProcessing, videos: VideoProcessing,
                serves_media: bool) -> tuple[list[dict], list[Media]]:
    """The messages as the chat template takes them, and their media processed in order."""
    media: list[Media] = []

    def take(kind: str, part: dict, where: str) -> None:
        if not serves_media:
            raise RequestError(where, "this checkpoint has no vision tower: text only")
        if len(media) >= limits.max_media:
            raise RequestError(where, f"at most {limits.max_media} images and videos per request")
        try:
            if kind == "image":
                media.append(_image(part.get("data"), limits, images))
            else:
                media.append(_video(part.get("data"), part.get("fps"), limits, videos))
        except MediaError as err:
            raise RequestError(where, str(err)) from None

    return split_content(messages, ("image", "video"), take), media


def _image(data, limits: MediaLimits, cfg: ImageProcessing) -> Media:
    if isinstance(data, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(data))
        except Exception as err:
            raise MediaError(f"cannot decode the image: {err}") from None
    elif isinstance(data, Image.Image):
        image = data
    else:
        raise MediaError("an image part needs data: image bytes")
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise MediaError(f"image of {width}x{height} = {width * height} pixels exceeds max_image_pixels "
                         f"({limits.max_image_pixels})")
    try:
        image.load()
    except Exception as err:
        raise MediaError(f"cannot decode the image: {err}") from None
    return process_image(image, cfg)


def _video(data, fps, limits: MediaLimits, cfg: VideoProcessing) -> Media:
    if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
        raise MediaError("fps must be a positive number")
    if isinstance(data, (bytes, bytearray)):
        video, indices = decode_animation(bytes(data), cfg, limits.max_video_pixels)
        if fps is not None:
            raise MediaError("fps is only for a video given as frames (an animated image carries its own rate)")
        return sampled_video(video, indices, cfg)
    if data is None:
        raise MediaError("a video part needs data: an animated image's bytes or a list of frames")
    video = frames_to_video(data, None if fps is None else float(fps))
    count, height, width = video.frames.shape[:3]
    sampled = len(sample_indices(count, video.fps, cfg))
    if sampled * height * width > limits.max_video_pixels:
        raise MediaError(f"{sampled} sampled frames of {width}x{height} are {sampled * height * width} pixels, "
                         f"over max_video_pixels ({limits.max_video_pixels})")
    return process_video(video, cfg)
