"""Cosmos3's action modes, as ``Cosmos3OmniPipeline`` defines them (its ``CosmosActionCondition``).

Three modes share one layout: an observation clip of ``action_chunk_size + 1`` pixel frames and
``action_chunk_size`` action tokens (one per transition between frames) after the video patches.

- ``policy``: an image (or a clip's first frame) in; the first latent frame is clean, the rest of
  the clip and every action are denoised; the actions come out.
- ``forward_dynamics``: an image and ``raw_actions`` in; the actions are clean conditions (a short
  list repeats its last action, a long one is cut); the video comes out.
- ``inverse_dynamics``: a clip in; every latent frame is clean; the actions come out.

The observation is fitted into a canvas picked by ``resolution_tier``: the tier's size whose aspect
ratio is nearest the source's (height over width). Each frame is first floored to multiples of 16
(PIL bilinear, diffusers' ``VideoProcessor``), mapped to ``[-1, 1]``, scaled down (never up) to fit
the canvas (bicubic, antialiased; sides ``int(scale * side + 0.5)``) and padded on the right and
bottom (reflected, or replicated where the pad is as wide as the content). The VAE encodes the
canvas; the latents keep only the content's ``side // 16`` (at least 1), so the video the tower
sees and makes is the content's, not the canvas's.

Actions are ``raw_action_dim`` wide (fixed per embodiment, the pipeline's table) and zero-padded to
the tower's ``action_dim``; the padded columns stay zero through the loop. The prompt is the
structured JSON caption the policies were trained on (``action_caption``); the negative prompt is
sent as it is, without metadata sentences.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from pydantic import Field

from mstar.model.knobs import RequestKnobs

Mode = Literal["policy", "forward_dynamics", "inverse_dynamics"]
SIZE_MULTIPLE = 16
TIME_COMPRESSION = 4

# embodiment -> the row of the domain-aware action heads
DOMAIN_IDS = {
    "no_action": 0, "av": 1, "camera_pose": 2, "hand_pose": 3, "pusht": 4, "libero": 5, "umi": 6,
    "bridge_orig_lerobot": 7, "droid_lerobot": 8, "robomind-franka": 8, "galbot": 9, "robomind-franka-dual": 12,
    "robomind-ur": 13, "agibotworld": 15, "agibot_gear_gripper": 15, "agibot_gear_gripper_ext": 15, "fractal": 20,
}
# embodiment -> its unpadded action width (9D poses, 1D grippers, 15D fingertips composed); the
# embodiments absent here (no_action, libero) have no fixed width and serve no action request
RAW_ACTION_DIMS = {
    "av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
    "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30, "agibotworld": 29,
    "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10, "hand_pose": 57,
}
# resolution tier -> {height / width: (height, width)} canvases
CANVASES: dict[int, dict[float, tuple[int, int]]] = {
    256: {1.0: (256, 256), 0.8: (256, 320), 1.25: (320, 256), 0.6: (192, 320), 320 / 192: (320, 192)},
    480: {1.0: (640, 640), 544 / 736: (544, 736), 736 / 544: (736, 544), 480 / 832: (480, 832),
          832 / 480: (832, 480)},
    704: {1.0: (960, 960), 832 / 1088: (832, 1088), 1088 / 832: (1088, 832), 0.55: (704, 1280),
          1280 / 704: (1280, 704)},
    720: {1.0: (960, 960), 832 / 1104: (832, 1104), 1104 / 832: (1104, 832), 0.5625: (720, 1280),
          1280 / 720: (1280, 720)},
}
VIEWPOINTS = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent from the "
                         "front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}


class ActionKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for an action request (a policy, forward or inverse
    dynamics). ``domain_name``, ``raw_action_dim`` and ``action_chunk_size`` default to the
    deployment's (``Cosmos3Knobs``)."""

    action_mode: Mode | None = None  # None: policy for an action output, forward dynamics for a video
    domain_name: str | None = None
    raw_action_dim: int | None = Field(None, ge=1)  # must be the domain's width
    action_chunk_size: int | None = Field(None, ge=1)
    raw_actions: list[list[float]] | None = None  # forward dynamics: [T, raw_action_dim]
    resolution_tier: Literal[256, 480, 704, 720] = 480
    view_point: str = "ego_view"
    fps: int = Field(24, ge=1, le=240)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str = ""
    seed: int | None = None
    width: int | None = None  # the video routes' size: if sent, the clip's (the observation's content)
    height: int | None = None
    num_frames: int | None = None  # if sent, action_chunk_size + 1
    conditioning_resize: str | None = None  # the video routes' i2v knob: the observation fits its canvas instead
    enable_sound: bool = False  # a soundtrack of the clip too (a checkpoint with the sound pathway)


def canvas(height: int, width: int, tier: int) -> tuple[int, int]:
    """The tier's ``(height, width)`` whose aspect ratio is nearest ``height / width``."""
    bins = CANVASES[tier]
    ratio = min(bins, key=lambda r: abs(r - height / width))
    return bins[ratio]


def floored(frame: np.ndarray) -> torch.Tensor:
    """An RGB ``uint8 [h, w, 3]`` frame floored to multiples of 16 (PIL bilinear) as ``float32
    [3, H, W]`` in ``[-1, 1]``."""
    image = Image.fromarray(np.ascontiguousarray(frame))
    size = (image.width - image.width % SIZE_MULTIPLE, image.height - image.height % SIZE_MULTIPLE)
    if size != image.size:
        image = image.resize(size, resample=Image.BILINEAR)
    pixels = np.asarray(image.convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * torch.from_numpy(pixels) - 1.0).permute(2, 0, 1)


def observation_pixels(frames: list[np.ndarray], num_frames: int, tier: int
                       ) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """The observation clip ``frames`` (``uint8 [h, w, 3]`` each; the first ``num_frames``, a short
    clip padded with its last frame) on its canvas: ``(pixels float32 [3, num_frames, H, W],
    canvas (H, W), content (h, w))``."""
    x = torch.stack([floored(f) for f in frames[:num_frames]])  # [F, 3, h, w]
    x = torch.cat([x, x[-1:].expand(num_frames - len(x), -1, -1, -1)]) if len(x) < num_frames else x
    h, w = x.shape[-2:]
    target_h, target_w = canvas(h, w, tier)
    scale = min(target_w / w, target_h / h, 1.0)
    content = (max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5)))
    if content != (h, w):
        x = F.interpolate(x, size=content, mode="bicubic", align_corners=False, antialias=True)
    pad_bottom, pad_right = target_h - content[0], target_w - content[1]
    if pad_right or pad_bottom:
        mode = "replicate" if pad_right >= content[1] or pad_bottom >= content[0] else "reflect"
        x = F.pad(x, (0, pad_right, 0, pad_bottom), mode=mode)
    return x.permute(1, 0, 2, 3).contiguous(), (target_h, target_w), content


def content_latents(content: tuple[int, int]) -> tuple[int, int]:
    """The latent rows and columns the content keeps."""
    return max(content[0] // SIZE_MULTIPLE, 1), max(content[1] // SIZE_MULTIPLE, 1)


def action_caption(description: str, *, view_point: str | None, num_frames: int, fps: float, height: int,
                   width: int) -> str:
    """The structured caption the action policies were trained on, as JSON: the framing of the
    viewpoint, the description as the one action over the clip, its duration, fps, resolution
    (the canvas) and nearest aspect ratio."""
    seconds = num_frames / fps if fps > 0 else 0.0
    finite = seconds >= 0 and math.isfinite(seconds)
    minutes, secs = divmod(round(seconds) if finite else 0, 60)
    text = description.strip()
    if text and not text.endswith((".", "!", "?")):
        text += "."
    caption: dict = {}
    if view_point in VIEWPOINTS:
        caption["cinematography"] = {"framing": VIEWPOINTS[view_point]}
    ratio = width / height if height > 0 else 1.0
    aspect = min(("1,1", "4,3", "3,4", "16,9", "9,16"), key=lambda r: abs(int(r[:r.index(",")]) /
                                                                          int(r[r.index(",") + 1:]) - ratio))
    caption["actions"] = [{"time": f"0:00-{minutes}:{secs:02d}", "description": text}]
    caption["duration"] = f"{int(seconds) if finite else 0}s"
    caption["fps"] = float(fps)
    caption["resolution"] = {"H": int(height), "W": int(width)}
    caption["aspect_ratio"] = aspect
    return json.dumps(caption)


def chunk_actions(raw: torch.Tensor, chunk: int, width: int) -> torch.Tensor:
    """Forward dynamics' actions ``[T, raw]``: ``chunk`` rows (the last repeated, or cut), zero-
    padded to the tower's ``width``."""
    if len(raw) < chunk:
        raw = torch.cat([raw, raw[-1:].expand(chunk - len(raw), -1)])
    return F.pad(raw[:chunk], (0, width - raw.shape[1]))
