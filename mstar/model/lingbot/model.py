"""LingBot-World v2 1.3B causal-fast: camera-controlled image-to-world video, streamed chunk by
chunk. The declaration.

Two nodes: the UMT5 prompt encoder, and ``world``, the rollout engine (the causal DiT with its
rolling KV cache and the Wan2.1 VAE, whose frame caches are per-rollout state too). The walk
encodes the prompt, then loops ``chunk`` once per chunk of ``chunk_frames`` latent frames, each
emitting its decoded frames as a ``video`` event (the first chunk 1 + 4 (c - 1) frames, every
later one 4c), so a client sees the world unfold while it is being made.

A request (``/generate`` with ``model_kwargs``, or ``/v1/videos/generations``) carries the start
image (required), the prompt, the size, ``num_frames`` (whole chunks: 1 + 4 (3k - 1) with the
default chunk) and the camera: ``camera_poses``, one pose per frame as ``[F, 4, 4]`` or ``[F, 3,
4]`` nested lists (None: a still camera), and ``intrinsics``. Checks name the field; nothing is
queued before they pass. Deployment knobs: ``LingbotKnobs``.

With ``session_id`` the rollout stays on the worker after the request; ``resume_session`` runs
the ``resume`` walk (no start image), whose chunks continue it: ``num_frames`` then counts the
new frames (``12k``), and the poses, one per new frame, extend the trajectory so far
(docs/lingbot.md).
"""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from mstar.contract import GenerateSpec, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.lingbot.camera import FRAME_STEP, as_poses
from mstar.model.lingbot.checkpoint import LingbotCheckpoint
from mstar.model.lingbot.config import LingbotConfig
from mstar.model.lingbot.knobs import LingbotKnobs, LingbotRequest
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.video_output import VideoFrames

SIZE_MULTIPLE = 16  # the VAE's 8, then the DiT's 2x2 patches
MAX_POSES_BYTES = 1 << 20  # the camera trajectory's JSON, as the API server caps a form field


def start_image(data: bytes, width: int, height: int) -> torch.Tensor:
    """The start image, RGB, resized to the video's size (bicubic, as the reference), ``[3, 1,
    H, W]`` in ``[-1, 1]``."""
    try:
        image = decode_image(data, field="image")
    except ImageError as err:
        raise RequestError(err.field, err.message, err.status) from None
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image).astype(np.float32) / 255.0)
    return (2.0 * pixels - 1.0).permute(2, 0, 1)[:, None].contiguous()


def camera_poses(options: LingbotRequest, frames: int) -> torch.Tensor:
    """The request's poses ``[frames, 4, 4]`` (a still camera when it sends none)."""
    if options.camera_poses is None:
        return torch.eye(4, dtype=torch.float64).repeat(frames, 1, 1)
    if len(json.dumps(options.camera_poses)) > MAX_POSES_BYTES:
        raise RequestError("camera_poses", f"is over {MAX_POSES_BYTES} bytes of JSON; send [F, 3, 4] rows")
    try:
        values = torch.tensor(options.camera_poses, dtype=torch.float64)
    except (ValueError, TypeError):
        raise RequestError("camera_poses", "must be [F, 4, 4] or [F, 3, 4] numbers") from None
    if values.ndim != 3 or values.shape[1:] not in ((4, 4), (3, 4)):
        raise RequestError("camera_poses", f"must be [F, 4, 4] or [F, 3, 4], got {list(values.shape)}")
    if values.shape[0] < frames:
        raise RequestError("camera_poses", f"has {values.shape[0]} poses for {frames} frames")
    if not torch.isfinite(values).all():
        raise RequestError("camera_poses", "must be finite numbers")
    poses = as_poses(values[:frames])
    if torch.linalg.det(poses[:, :3, :3]).abs().min() < 1e-6:
        raise RequestError("camera_poses", "has a pose whose rotation is singular")
    return poses


@register
class LingbotWorld(ModelSpec):
    key = "lingbot_world_1_3b"
    tasks = frozenset({"video_generation"})
    video_frame_step = FRAME_STEP
    video_knobs = LingbotRequest
    video_needs_image = True  # image-to-world: a request without a start image is refused
    input_modalities = frozenset({"text", "image"})
    default_weights = "robbyant/lingbot-world-v2-1.3b-causal-fast"
    Knobs = LingbotKnobs
    knobs: LingbotKnobs

    def graph(self) -> Graph:
        text_encoder = Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text",))
        world = Node("world", "denoise", inputs=("text", "pixels", "camera"), outputs=("frames",), ops=("chunk",))
        walk = Walk("i2w", Sequential(
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text"),
            Loop(Step("world", "chunk", reads=("text", "pixels", "camera"), writes="frames",
                      emit=Emit("frames", "video")), max_iters="num_chunks", progress=True),
        ), inputs=("prompt_ids", "prompt_mask", "pixels", "camera"))
        resume = Walk("resume", Sequential(  # a session's next chunks: no start image, the rollout has it
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text"),
            Loop(Step("world", "chunk", reads=("text", "camera"), writes="frames",
                      emit=Emit("frames", "video")), max_iters="num_chunks", progress=True),
        ), inputs=("prompt_ids", "prompt_mask", "camera"))
        return Graph.build([text_encoder, world], [walk, resume])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> LingbotCheckpoint:
        return LingbotCheckpoint.locate(self.config.model_path or self.default_weights, self.knobs.assets_path,
                                        self.config.cache_dir)

    def model_config(self, ckpt: LingbotCheckpoint) -> LingbotConfig:
        config = ckpt.config()
        k = self.knobs
        window = config.window_frames if k.window_frames is None else k.window_frames
        sink = config.sink_frames if k.sink_frames is None else k.sink_frames
        return LingbotConfig(**{**config.__dict__, "window_frames": window, "sink_frames": sink,
                                "chunk_frames": k.chunk_frames})

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.text = ckpt.text()
        self.world = self.model_config(ckpt)

    def check(self, spec: GenerateSpec) -> tuple[LingbotRequest, torch.Tensor | None, torch.Tensor, int]:
        """The request's options, start image (None when it resumes a session), latent frames'
        camera poses and chunk count; a ``RequestError`` naming the field for anything wrong."""
        if set(spec.output_modalities) != {"video"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs video only")
        options = LingbotRequest.parse(spec.model_kwargs)
        resume = spec.session is not None and spec.session.resume
        if not spec.text.strip():
            raise RequestError("prompt", "must not be empty")
        for field, side in (("width", options.width), ("height", options.height)):
            if side % SIZE_MULTIPLE:
                raise RequestError(field, f"must be a positive multiple of {SIZE_MULTIPLE}, got {side}")
        if options.width * options.height > self.knobs.max_image_area:
            raise RequestError("width", f"{options.width}x{options.height} is over max_image_area "
                                        f"({self.knobs.max_image_area} pixels a frame)")
        chunk = self.knobs.chunk_frames
        whole = FRAME_STEP * chunk  # video frames a chunk after the first
        if resume:  # later chunks only: 4c video frames each
            if options.num_frames % whole or options.num_frames > self.knobs.max_frames:
                raise RequestError("num_frames", f"resuming a session, must be {whole}k (whole later chunks of "
                                                 f"{chunk} latent frames) and at most {self.knobs.max_frames}, "
                                                 f"got {options.num_frames}")
        elif (options.num_frames + FRAME_STEP - 1) % whole or options.num_frames > self.knobs.max_frames:
            low = max(1, (options.num_frames + FRAME_STEP - 1) // whole) * whole - FRAME_STEP + 1
            raise RequestError("num_frames", f"must be {whole}k - {FRAME_STEP - 1} (whole chunks of {chunk} latent "
                                             f"frames) and at most {self.knobs.max_frames}, got {options.num_frames} "
                                             f"(nearest: {low})")
        if resume and spec.files:
            raise RequestError("image", "a resumed session continues its rollout's video; send no start image")
        if not resume and len(spec.files) != 1:
            raise RequestError("image", f"LingBot-World starts from one image, got {len(spec.files)}")
        if options.intrinsics is not None and len(options.intrinsics) != 4:
            raise RequestError("intrinsics", "must be [fx, fy, cx, cy]")
        poses = camera_poses(options, options.num_frames)
        if resume:  # frame 4c k - 3 + 4j + 3 of the whole video is latent frame c k + j's
            return options, None, poses[FRAME_STEP - 1::FRAME_STEP], options.num_frames // whole
        pixels = start_image(spec.files[0][1], options.width, options.height)
        latent_frames = (options.num_frames - 1) // FRAME_STEP + 1
        return options, pixels, poses[::FRAME_STEP], latent_frames // chunk

    def check_video(self, spec: GenerateSpec) -> None:
        """The request's checks without queueing anything (the video job route runs them first)."""
        self.check(spec)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        options, pixels, poses, chunks = self.check(spec)
        ids, mask = self.text.tokenize(spec.text)
        seed = options.seed if options.seed is not None else torch.seed() % (1 << 31)
        inputs = {"prompt_ids": ids, "prompt_mask": mask, "camera": poses}  # absolute poses: the engine
        # makes them relative to the rollout's trajectory so far
        params = {"num_chunks": chunks, "seed": seed, "intrinsics": options.intrinsics,
                  "camera_given": options.camera_poses is not None,
                  "num_frames": options.num_frames, "fps": options.fps}
        if pixels is None:
            return WalkRequest("resume", inputs, params, prompt_tokens=int(mask.sum()))
        return WalkRequest("i2w", inputs | {"pixels": pixels}, params, prompt_tokens=int(mask.sum()))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> VideoFrames:
        return VideoFrames()

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.diffusion_engines import text_encoder_engine
        from mstar.model.lingbot.engine import WorldEngine
        from mstar.model.wan22.vae import WanVAE

        ckpt = self.checkpoint()
        dummy = self.config.load_format == "dummy"
        engines = {}
        if "text_encoder" in nodes:
            engines["text_encoder"] = text_encoder_engine(ckpt.text(), ckpt.assets.loader(self.config, self.knobs.seed,
                                                                                          device))
        if "world" in nodes:
            dtype = self.config.torch_dtype()
            dit = ckpt.load_dit(self.model_config(ckpt), device=device, dtype=dtype, dummy=dummy,
                                seed=self.knobs.seed + 2)
            vae = ckpt.assets.load(lambda: WanVAE(ckpt.vae_config()), "vae", device=device, dtype=torch.float32,
                                   dummy=dummy, seed=self.knobs.seed + 3)
            engines["world"] = WorldEngine(dit, vae, device)
        return engines
