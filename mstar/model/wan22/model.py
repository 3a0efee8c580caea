"""Wan2.2-TI2V-5B text-to-video and image-to-video: the declaration.

Three nodes: the UMT5 prompt encoder, the DiT as a denoise engine (a Loop of UniPC steps over
the latents ``[48, 1 + (F - 1) / 4, H / 16, W / 16]``), and the Wan2.2 VAE (``encode`` the
image of an i2v request, ``decode`` the final latents to uint8 frames ``[F, H, W, 3]``, emitted
as the request's ``video``). An image among the request's files turns it into image-to-video.

Guidance (5 by default): the ``*_guided`` walks encode the negative prompt beside the prompt,
and each step runs a conditional and an unconditional prediction, either as a batched pair in
one DiT forward (default) or, with ``cfg_parallel``, as ``Parallel`` branches on nodes ``dit``
and ``dit_uncond`` (the same DiT under a second name, so the YAML places the branches on one
rank or two) joined by ``dit: guide``. ``guidance_scale`` 1 takes the plain walks.

Sizes are checked before queueing: width and height multiples of 32 (the VAE's 16 times the
DiT's 2x2 patches), ``num_frames`` of the form 4k + 1 (the VAE codes the first frame alone,
then four at a time), ``width x height`` within ``max_image_area`` and ``width x height x
num_frames`` within ``max_video_pixels``, each axis within the DiT's 1024 rotary positions.
Deployment knobs (``model_kwargs``): ``WanKnobs``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from pydantic import Field

from mstar.contract import GenerateSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.graph import Emit, Graph, Loop, Node, Parallel, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.diffusion_knobs import MAX_STEPS
from mstar.model.knobs import RequestKnobs
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.video_output import VideoFrames
from mstar.model.wan22.checkpoint import WanCheckpoint
from mstar.model.wan22.knobs import WanKnobs

SIZE_MULTIPLE = 32  # VAE 16x, then the DiT's 2x2 patches
FRAME_STEP = 4  # the VAE's time compression: num_frames = 1 + 4k
MAX_SIDE = 16384  # the largest side an H.264 encoder opens
ROPE_POSITIONS = 1024  # the DiT's rotary table, per axis
UNCOND_NODE = "dit_uncond"  # the unconditional branch's node under cfg_parallel (the same DiT)


class VideoKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for a video request."""

    height: int = Field(704, ge=1)
    width: int = Field(1280, ge=1)
    num_frames: int = Field(81, ge=1)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str = ""
    seed: int | None = None
    fps: int = Field(24, ge=1, le=240)  # playback rate only: the container's, not a generation knob


def check_video_size(width: int, height: int, num_frames: int, max_video_pixels: int, max_image_area: int) -> None:
    """``RequestError`` naming the field for a size the model cannot make or the caps refuse."""
    for field, side in (("width", width), ("height", height)):
        if side % SIZE_MULTIPLE or side < SIZE_MULTIPLE:
            low = side // SIZE_MULTIPLE * SIZE_MULTIPLE
            near = f"{low} or {low + SIZE_MULTIPLE}" if low else str(SIZE_MULTIPLE)
            raise RequestError(field, f"must be a positive multiple of {SIZE_MULTIPLE}, got {side} (nearest: {near})")
        if side > MAX_SIDE:
            raise RequestError(field, f"must be at most {MAX_SIDE}, got {side}")
    if width * height > max_image_area:
        raise RequestError("width", f"{width}x{height} is over max_image_area ({max_image_area} pixels a frame)")
    if (num_frames - 1) % FRAME_STEP:
        low = (num_frames - 1) // FRAME_STEP * FRAME_STEP + 1
        raise RequestError("num_frames", f"must be {FRAME_STEP}k + 1 (1, 5, 9, ..., 81), got {num_frames} "
                                         f"(nearest: {low} or {low + FRAME_STEP})")
    latent_frames = (num_frames - 1) // FRAME_STEP + 1
    if latent_frames > ROPE_POSITIONS:
        raise RequestError("num_frames", f"must be at most {(ROPE_POSITIONS - 1) * FRAME_STEP + 1}, got {num_frames}")
    if width * height * num_frames > max_video_pixels:
        raise RequestError("num_frames", f"{width}x{height}x{num_frames} is over max_video_pixels "
                                         f"({max_video_pixels} pixels)")


def image_pixels(data: bytes, width: int, height: int) -> torch.Tensor:
    """An i2v request's image as the pipeline conditions on it: RGB, resized to the video's size
    (Lanczos), ``[3, 1, H, W]`` in ``[-1, 1]``."""
    try:
        image = decode_image(data, field="image")
    except ImageError as err:
        raise RequestError(err.field, err.message, err.status) from None
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    pixels = torch.from_numpy(np.asarray(image).astype(np.float32) / 255.0)
    return (2.0 * pixels - 1.0).permute(2, 0, 1)[:, None].contiguous()


@register
class Wan22(ModelSpec):
    key = "wan22"
    tasks = frozenset({"video_generation"})
    video_frame_step = FRAME_STEP
    video_knobs = VideoKnobs
    input_modalities = frozenset({"text", "image"})
    default_weights = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    Knobs = WanKnobs
    knobs: WanKnobs

    def graph(self) -> Graph:
        text_encoder = Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text",))
        dit = Node("dit", "denoise", inputs=("latents", "text", "negative_text", "condition", "v_cond", "v_uncond"),
                   outputs=("latents", "velocity"), ops=("step", "velocity", "guide"))
        vae = Node("vae", "stateless", inputs=("pixels", "latents"), outputs=("condition", "frames"),
                   ops=("encode", "decode"))
        nodes = [text_encoder, dit, vae]
        if self.knobs.cfg_parallel:
            nodes.append(Node(UNCOND_NODE, "denoise", inputs=("latents", "text", "condition"), outputs=("velocity",),
                              ops=("velocity",)))
        return Graph.build(nodes, [self._walk(i2v, guided) for i2v in (False, True) for guided in (False, True)])

    def _denoise(self, i2v: bool, guided: bool):
        """One denoise step: a ``step`` (a guided one as the batched pair), or with
        ``cfg_parallel`` the two branches in ``Parallel`` then ``guide``."""
        cond = {"latents": "latents", "text": "text", **({"condition": "condition"} if i2v else {})}
        if not guided:
            return Step("dit", "step", reads=cond, writes="latents")
        if not self.knobs.cfg_parallel:
            return Step("dit", "step", reads={**cond, "negative_text": "negative_text"}, writes="latents")
        uncond = {**cond, "text": "negative_text"}
        joined = ("latents", "v_cond", "v_uncond", *(("condition",) if i2v else ()))
        return Sequential(
            Parallel(Step("dit", "velocity", reads=cond, writes={"velocity": "v_cond"}, name="dit.cond"),
                     Step(UNCOND_NODE, "velocity", reads=uncond, writes={"velocity": "v_uncond"},
                          name="dit.uncond")),
            Step("dit", "guide", reads=joined, writes="latents"),
        )

    def _walk(self, i2v: bool, guided: bool) -> Walk:
        encoders = [Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text")]
        inputs = ["prompt_ids", "prompt_mask", "latents"]
        if guided:
            encoders.append(Step("text_encoder", reads={"prompt_ids": "negative_ids", "prompt_mask": "negative_mask"},
                                 writes={"text": "negative_text"}, name="text_encoder.negative"))
            inputs += ["negative_ids", "negative_mask"]
        if i2v:
            encoders.append(Step("vae", "encode", reads="pixels", writes="condition"))
            inputs.append("pixels")
        name = ("i2v" if i2v else "t2v") + ("_guided" if guided else "")
        return Walk(name, Sequential(
            Parallel(*encoders) if len(encoders) > 1 else encoders[0],
            Loop(self._denoise(i2v, guided), max_iters="num_steps", progress=True),
            Step("vae", "decode", reads="latents", writes="frames", emit=Emit("frames", "video")),
        ), inputs=tuple(inputs))

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> WanCheckpoint:
        return WanCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        ckpt.check_variant()
        self.text = ckpt.text()
        self.latent_channels = ckpt.transformer_config().in_channels
        self.vae_config = ckpt.vae_config()

    def check_video(self, spec: GenerateSpec) -> tuple[VideoKnobs, int, float, torch.Tensor | None]:
        """The request's checks, each a ``RequestError`` naming the field, without queueing
        anything (the job route runs them before it answers): its knobs, steps, guidance scale
        and image pixels."""
        if set(spec.output_modalities) != {"video"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs video only")
        knobs = VideoKnobs.parse(spec.model_kwargs)
        if not spec.text.strip():
            raise RequestError("prompt", "must not be empty")
        check_video_size(knobs.width, knobs.height, knobs.num_frames, self.knobs.max_video_pixels,
                         self.knobs.max_image_area)
        steps = self.knobs.num_inference_steps if knobs.num_inference_steps is None else knobs.num_inference_steps
        if not 1 <= steps <= MAX_STEPS:
            raise RequestError("num_inference_steps", f"must be between 1 and {MAX_STEPS}")
        scale = self.knobs.guidance_scale if knobs.guidance_scale is None else knobs.guidance_scale
        if not (math.isfinite(scale) and scale >= 1):
            raise RequestError("guidance_scale", "must be a number >= 1 (1 turns guidance off)")
        if len(spec.files) > 1:
            raise RequestError("image", f"image-to-video takes one image, got {len(spec.files)}")
        pixels = image_pixels(spec.files[0][1], knobs.width, knobs.height) if spec.files else None
        return knobs, steps, scale, pixels

    def prepare_video(self, spec: GenerateSpec) -> WalkRequest:
        knobs, steps, scale, pixels = self.check_video(spec)
        ids, mask = self.text.tokenize(spec.text)
        spatial = self.vae_config.scale_factor_spatial
        shape = (1, self.latent_channels, (knobs.num_frames - 1) // FRAME_STEP + 1, knobs.height // spatial,
                 knobs.width // spatial)
        seed = knobs.seed if knobs.seed is not None else torch.seed() % (1 << 31)
        inputs = {"prompt_ids": ids, "prompt_mask": mask,
                  "latents": FlowMatchEuler.initial_noise_soon(shape, seed, finish=lambda n: n[0])}
        params = {"num_steps": steps, "num_frames": knobs.num_frames, "fps": knobs.fps}
        if scale > 1:
            inputs["negative_ids"], inputs["negative_mask"] = self.text.tokenize(knobs.negative_prompt)
            params["guidance_scale"] = scale
        if pixels is not None:
            inputs["pixels"] = pixels
        walk = ("i2v" if pixels is not None else "t2v") + ("_guided" if scale > 1 else "")
        return WalkRequest(walk, inputs, params, prompt_tokens=int(mask.sum()))

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        return self.prepare_video(spec)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> VideoFrames:
        return VideoFrames()

    def parallel_dims(self) -> dict:
        """The DiT nodes (``dit``, and ``dit_uncond`` under ``cfg_parallel``) split their heads
        over ``tp_size`` (and ``tp_size x sp_size`` with Ulysses) and their FFN width over
        ``tp_size``; the text encoder and the VAE run whole. Token counts need no check: the
        sequence shards may be uneven."""
        from mstar.distributed.dims import ParallelDims

        c = self.checkpoint().transformer_config()
        heads = {"num_attention_heads": c.num_attention_heads}
        dims = ParallelDims(tensor={**heads, "ffn_dim": c.ffn_dim}, sequence=heads)
        return {name: dims for name, node in self.graph().nodes.items() if node.kind == "denoise"}

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        """The engines of ``nodes``; ``dit_uncond`` is the DiT's engine (shared with ``dit`` when
        both are on this rank: one copy of the weights, both branches' rows in its forwards)."""
        from mstar.model.wan22.engine import wan_engines

        ckpt = self.checkpoint()
        ckpt.check_variant()
        wanted = set(nodes) - {UNCOND_NODE} | ({"dit"} if UNCOND_NODE in nodes else set())
        engines = wan_engines(ckpt, self.knobs, self.config, wanted, device)
        if UNCOND_NODE in nodes:
            engines[UNCOND_NODE] = engines["dit"]
            if "dit" not in nodes:
                del engines["dit"]
        return engines
