"""Waypoint-1.5 (``Overworld/Waypoint-1.5-1B``): a seed image and controls -> live video frames.

One node, ``world`` (``mstar.model.waypoint.engine``), and two walks: ``rollout``::

    start [pixels -> latent]                 the seed image encoded by TAEHV, appended as frame 0
    Loop(frame [controls, latent -> frames]) one control per iteration: a latent frame denoised
                                             over the KV cache of past frames, decoded; emitted

and ``resume``, the loop alone, for a request that continues its session's rollout.

``/generate`` takes the seed image as its one file and ``model_kwargs`` ``{"controls": [{"buttons":
[..], "mouse": [x, y], "scroll": -1|0|1}, ...], "seed": n}`` with ``output_modalities=["video"]``;
each step's frames stream out as they are made, one ``video`` event per control: uint8 RGB, frame
after frame, ``time_upscale`` frames of ``height x width`` (the display size, ``frame_shape``).
With ``session_id`` the rollout stays on the worker after the request; ``resume_session`` runs
the ``resume`` walk (controls only, no seed image) whose frames continue it.
The seed image is resized (bilinear) to the autoencoder's size; for the released 16:8 latent
grids the frames are resized back to 16:9 (720p or 360p), as the reference does. A client that
sends controls one message at a time (``/generate/ws``: the opening names the seed image and
``seed``, each ``append`` its controls) drives the same ``Rollout`` step by step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar.contract import GenerateSpec, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.model.video_output import VideoFrames
from mstar.model.waypoint.checkpoint import WaypointCheckpoint
from mstar.model.waypoint.engine import FRAME, START, control_vector
from mstar.model.waypoint.knobs import WaypointKnobs, WaypointRequest
from mstar.model.waypoint.rollout import DISPLAY_SIZES


@register
class Waypoint(ModelSpec):
    key = "waypoint"
    tasks = frozenset()  # /generate only
    generate_modalities = (frozenset({"image"}), frozenset({"video"}))
    default_weights = "Overworld/Waypoint-1.5-1B"
    Knobs = WaypointKnobs
    knobs: WaypointKnobs

    def graph(self) -> Graph:
        world = Node("world", "denoise", inputs=("pixels", "controls", "latent"), outputs=("latent", "frames"),
                     ops=(START, FRAME))
        rollout = Walk("rollout", Sequential(
            Step("world", START, reads="pixels", writes="latent"),
            Loop(Step("world", FRAME, reads=("controls", "latent"), writes="frames", emit=Emit("frames", "video")),
                 max_iters="num_frames"),
        ), inputs=("pixels", "controls"))
        resume = Walk("resume", Loop(  # a session's next controls: its rollout goes on from its last frame
            Step("world", FRAME, reads="controls", writes="frames", emit=Emit("frames", "video")),
            max_iters="num_frames"), inputs=("controls",))
        return Graph.build([world], [rollout, resume])

    def checkpoint(self) -> WaypointCheckpoint:
        return WaypointCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    # -------------------------------------------------------------- frontend
    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.world_config = ckpt.config()
        ae = ckpt.ae_config()
        c = self.world_config
        self.pixel_size = (c.height * c.patch[0] * ae.space_scale, c.width * c.patch[1] * ae.space_scale)
        height, width = DISPLAY_SIZES.get(self.pixel_size, self.pixel_size)
        self.frame_shape = (ae.time_upscale, height, width, 3)  # one step's frames, as sent
        self.max_controls = min(self.knobs.max_frames, c.n_frames - 1)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if list(spec.output_modalities) != ["video"]:
            raise RequestError("output_modalities", f"model {self.key!r} outputs [\"video\"] only")
        options = WaypointRequest.parse(spec.model_kwargs)
        resume = spec.session is not None and spec.session.resume
        if resume and spec.files:
            raise RequestError("files", "a resumed session continues its rollout; send no seed image")
        if not resume and len(spec.files) != 1:
            raise RequestError("files", f"expected one seed image, got {len(spec.files)}")
        if len(options.controls) > self.max_controls:
            raise RequestError("controls", f"at most {self.max_controls} controls a request, "
                                           f"got {len(options.controls)}")
        n_buttons = self.world_config.n_buttons
        rows = []
        for i, control in enumerate(options.controls):
            bad = [b for b in control.buttons if not 0 <= b < n_buttons]
            if bad:
                raise RequestError(f"controls[{i}].buttons", f"button ids must be in [0, {n_buttons}), got {bad}")
            rows.append(control_vector(control.buttons, control.mouse, control.scroll, n_buttons))
        if resume:  # the seed image, the noise stream and the frame count are the session's
            return WalkRequest("resume", {"controls": torch.stack(rows)}, {"num_frames": len(rows)})
        pixels = self.pixels(spec.files[0][1])
        seed = options.seed if options.seed is not None else torch.seed() % (1 << 31)
        inputs = {"pixels": pixels, "controls": torch.stack(rows)}
        return WalkRequest("rollout", inputs, {"num_frames": len(rows), "seed": seed})

    def pixels(self, data: bytes) -> torch.Tensor:
        """The seed image as RGB ``[3, H, W]`` in [0, 1] at the autoencoder's size (bilinear, as
        the reference resizes its 16:9 frames to 16:8)."""
        try:
            image = decode_image(data, field="files[0]")
        except ImageError as err:
            raise RequestError(err.field, err.message, err.status) from None
        rgb = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        if tuple(rgb.shape[1:]) != self.pixel_size:
            rgb = F.interpolate(rgb[None], size=self.pixel_size, mode="bilinear", align_corners=False)[0]
        return rgb.contiguous()

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return VideoFrames()

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.waypoint.engine import WaypointEngine

        world = self.checkpoint().load_world(device, self.config.torch_dtype(),
                                             dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        return {"world": WaypointEngine(world)}
