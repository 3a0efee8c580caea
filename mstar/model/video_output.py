"""The output side shared by the video families: emitted ``uint8 [F, H, W, 3]`` frames ->
client events carrying their raw bytes (frame-major RGB). The mp4 container, where a route
wants one, is made in the server (``mstar.server.video_routes``)."""

from __future__ import annotations

import torch

from mstar.contract import OutputEvent
from mstar.model.spec import OutputStream

__all__ = ["VideoFrames"]


class VideoFrames(OutputStream):
    """Each emitted batch of frames (a whole clip, a rollout's chunk or one step's frames) ->
    one ``video`` event of their raw bytes; ``generated`` counts the frames."""

    def __init__(self) -> None:
        self.frames = 0

    @property
    def generated(self) -> int:
        return self.frames

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        self.frames += int(value.shape[0])
        return OutputEvent(modality="video", data=value.contiguous().numpy().tobytes())
