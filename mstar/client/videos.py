"""Video generation for ``MStarClient``: ``generate_video`` (/v1/videos/generations), as a mixin.
It returns a ``VideoResult``: the mp4's bytes in ``.data``, written to a file by ``.save``.

    >>> video = client.generate_video("a cat walks on the moon", width=1280, height=704, seconds=2, seed=7)
    >>> video.save("cat.mp4")
    >>> still = client.generate_video("it starts to snow", image="cat.png", num_frames=41)
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mstar.client.images import ImageInput


@dataclass
class VideoResult:
    """An H.264 mp4."""

    data: bytes

    def save(self, path: str | PathLike[str]) -> Path:
        """Write the mp4 to ``path``; returns it."""
        target = Path(path)
        target.write_bytes(self.data)
        return target


def _data_uri(image: ImageInput) -> str:
    data = bytes(image) if isinstance(image, (bytes, bytearray)) else Path(image).read_bytes()
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


class VideosMixin:
    """``MStarClient``'s video method."""

    if TYPE_CHECKING:  # provided by MStarClient

        def _json(self, method: str, url: str, **kwargs: Any) -> Any: ...

    def generate_video(
        self,
        prompt: str,
        *,
        width: int | None = None,
        height: int | None = None,
        seconds: float | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        image: ImageInput | None = None,
        seed: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        negative_prompt: str | None = None,
        model: str | None = None,
    ) -> VideoResult:
        """Text (and with ``image``, a path or bytes, image) to video. Without ``width`` and
        ``height``, or ``seconds`` / ``num_frames``, the model's defaults (Wan2.2: 1280x704,
        81 frames at 24 fps); ``seconds`` becomes the nearest frame count the model takes."""
        if (width is None) != (height is None):
            raise ValueError("give both width and height, or neither")
        values = dict(model=model, size=f"{width}x{height}" if width is not None else None, seconds=seconds,
                      num_frames=num_frames, fps=fps, image=None if image is None else _data_uri(image), seed=seed,
                      num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                      negative_prompt=negative_prompt)
        body = {"prompt": prompt, **{k: v for k, v in values.items() if v is not None}}
        raw = self._json("POST", "/v1/videos/generations", json=body)
        return VideoResult(base64.b64decode(raw["data"][0]["b64_json"]))
