"""The pixels Cosmos3 conditions a clip on, prepared as ``Cosmos3OmniPipeline`` prepares them.

Image-to-video: the image is scaled to cover the output size with its aspect ratio kept (each
side ``ceil(scale * side)``, ``scale`` the larger of the two side ratios; antialiased bilinear on
the 0..255 scale), center-cropped (offsets rounded half to even, as Python rounds), rounded to
8 bits and mapped to ``[-1, 1]``. ``conditioning_resize: stretch`` resizes straight to the output
size instead (the same antialiased bilinear, aspect ratio not kept, rounded the same way).
The result is the clip's first pixel frame; its first latent frame is pinned clean.

Video-to-video: each frame is resized to the output size with PIL's bilinear filter (unless it
already has it), scaled to ``[0, 1]`` and mapped to ``[-1, 1]`` (diffusers' ``VideoProcessor``
on PIL frames). The first ``1 + 4 (k - 1)`` frames are kept for ``k`` conditioned latent frames,
a short clip padded with its last frame.

Only the conditioned frames are encoded: the Wan2.2 VAE is causal in time, so latent frame
``j`` depends on pixel frames ``0 .. 4j`` alone, and the pipeline's encode of the whole padded
clip gives the same leading latents.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

Resize = Literal["cover", "stretch"]
RESIZE_MODES: tuple[str, ...] = ("cover", "stretch")
TIME_COMPRESSION = 4


def image_pixels(image: Image.Image, width: int, height: int, resize: Resize = "cover") -> torch.Tensor:
    """An i2v request's RGB ``image`` as the clip's first frame: ``float32 [3, 1, H, W]`` in
    ``[-1, 1]``."""
    if resize not in RESIZE_MODES:
        raise ValueError(f"conditioning_resize must be one of {list(RESIZE_MODES)}, got {resize!r}")
    x = torch.from_numpy(np.array(image.convert("RGB"), copy=True)).permute(2, 0, 1)[None].float()
    src_h, src_w = x.shape[-2:]
    if resize == "cover":
        scale = max(width / src_w, height / src_h)
        size = (math.ceil(scale * src_h), math.ceil(scale * src_w))
    else:
        size = (height, width)
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    top, left = round((size[0] - height) / 2), round((size[1] - width) / 2)
    x = x[:, :, top:top + height, left:left + width]
    return (x.round().clamp(0, 255) / 127.5 - 1.0)[0, :, None].contiguous()


def condition_length(latent_frames: int) -> int:
    """Pixel frames behind ``latent_frames`` leading latent frames."""
    return 1 + TIME_COMPRESSION * (latent_frames - 1)


def video_pixels(frames: np.ndarray, width: int, height: int, latent_frames: int) -> torch.Tensor:
    """A v2v request's clip ``uint8 [N, h, w, 3]`` as the pixels of its ``latent_frames``
    conditioned latent frames: ``float32 [3, 1 + 4 (latent_frames - 1), H, W]`` in ``[-1, 1]``."""
    if len(frames) < 1:
        raise ValueError("the clip has no frames")
    need = condition_length(latent_frames)
    kept = list(frames[:need])
    kept += [kept[-1]] * (need - len(kept))
    out = []
    for frame in kept:
        image = Image.fromarray(np.ascontiguousarray(frame)).convert("RGB")
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.BILINEAR)
        out.append(np.asarray(image).astype(np.float32) / 255.0)
    pixels = torch.from_numpy(np.stack(out))  # [F, H, W, 3]
    return (2.0 * pixels - 1.0).permute(3, 0, 1, 2).contiguous()
