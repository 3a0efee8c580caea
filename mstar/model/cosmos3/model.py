"""Cosmos3 text-to-image and text-to-video: the declaration.

Two nodes: the tower as a denoise engine (``dit``: a Loop of UniPC steps over the latents
``[48, 1 + (F - 1) / 4, H / 16, W / 16]``; the prompt's text pathway runs inside it once per
request, see ``mstar.model.cosmos3.denoise``) and the Wan2.2 VAE (``decode`` to uint8 frames
``[F, H, W, 3]``, emitted as ``video``; ``decode_image`` to one ``[H, W, 3]`` image). A request
with one frame is text-to-image: the same tower and layout with a single latent frame.

Guidance (6 by default, as the pipeline): the ``*_guided`` walks carry the negative prompt's
ids too and each step runs both rows in one tower forward. ``guidance_scale`` 1 takes the plain
walks. The prompt gets the pipeline's metadata sentences (duration, fps, resolution), and the
fps also scales the video's rotary time axis, so it is a generation knob here, not only the
container's rate.

Sizes are checked before queueing: width and height positive multiples of 16 (the VAE;
the tower pads odd patch grids), ``num_frames`` of the form 4k + 1, within ``max_image_area``
and ``max_video_pixels``. Deployment knobs: ``Cosmos3Knobs``.

A file in a video request conditions the clip: an image (image-to-video, the ``i2v`` walks) is
the first frame, a video (video-to-video, the ``v2v`` walks) gives the first
``condition_latent_frames`` latent frames (2 by default: its first 5 frames). The frontend
prepares the pixels (``mstar.model.cosmos3.conditioning``), the VAE's ``encode`` turns them into
``cond_latents`` before the denoise Loop, and the tower keeps those frames clean.

Sound (``enable_sound``, opt-in as the pipeline's ``enable_sound``; a 400 naming it on a
checkpoint without ``sound_tokenizer/`` and a ``sound_gen`` tower, or a distilled one): the
``*_sound`` walks carry ``sound_latents [sound_dim, T]`` (noise drawn after the video's from the
same seed) through the denoise Loop beside the video and then through the ``sound`` node (the
AVAE decoder), emitted as ``audio`` (``mstar.model.cosmos3.sound``); the video routes mux it
into the mp4 as AAC.

On a checkpoint with action heads (``action_gen``: the DROID policies) a request may take an
action mode (``mstar.model.cosmos3.action``): ``output_modalities: ["action"]`` is a policy (an
image in) or, with ``action_mode: inverse_dynamics``, inverse dynamics (a clip in); a video
request with ``action_mode: forward_dynamics`` and ``raw_actions`` rolls the observation forward.
The ``act_*`` walks encode the observation, denoise the clip and the action chunk together, and
emit the actions (``[action_chunk_size, raw_action_dim]`` float32) or the video. On a checkpoint
with both pathways an action request may set ``enable_sound`` too (the pipeline takes ``action``
and ``enable_sound`` together): the ``act_*_sound`` walks pack the video, the sound and the
actions in that order, each with its own UniPC state, and emit the soundtrack of the ``chunk + 1``
frame clip as ``audio``. Windowed rollouts: ``mstar.model.cosmos3.windowed``; the Edge
reasoner: ``mstar.model.cosmos3.chat``.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Literal

import torch
from pydantic import Field

from mstar.contract import GenerateSpec, ImageSpec, RequestError
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.cosmos3.action_request import ActionChunk, ActionRequests
from mstar.model.cosmos3.chat import ReasonerChat
from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
from mstar.model.cosmos3.conditioning import condition_length, image_pixels, video_pixels
from mstar.model.cosmos3.knobs import Cosmos3Knobs
from mstar.model.cosmos3.sampler import draws
from mstar.model.cosmos3.sound import SoundLayout, SoundVideoStream
from mstar.model.cosmos3.windowed import (
    KV_WARNING,
    WindowedVideo,
    plan_windowed,
    prepare_windowed,
    windowed_walks,
)
from mstar.model.diffusion_knobs import MAX_STEPS
from mstar.model.image_output import ImageGenerateKnobs, ImageStream, output_params
from mstar.model.knobs import RequestKnobs
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, WalkRequest
from mstar.model.video_output import VideoFrames

SIZE_MULTIPLE = 16  # the VAE's spatial compression
FRAME_STEP = 4  # the VAE's time compression: num_frames = 1 + 4k
MAX_SIDE = 16384
# the distilled checkpoints' noise (latents and one draw a step), drawn off the request path
_NOISE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cosmos3-noise")
log = logging.getLogger(__name__)


class VideoKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for a video request (the pipeline's defaults)."""

    takes_video: ClassVar[bool] = True  # /v1/videos/generations' ``video`` field: a clip to continue

    height: int = Field(720, ge=1)
    width: int = Field(1280, ge=1)
    num_frames: int = Field(189, ge=1)
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str = ""
    seed: int | None = None
    fps: int = Field(24, ge=1, le=240)  # in the prompt's metadata and the rotary time axis
    conditioning_resize: Literal["cover", "stretch"] | None = None  # i2v; None: the deployment's
    condition_latent_frames: int = Field(2, ge=1)  # v2v: leading latent frames taken from the clip
    enable_sound: bool = False  # a soundtrack with the clip (the pipeline's enable_sound)
    # windowed rollouts (mstar.model.cosmos3.windowed; the deployment's enable_windowed_video)
    window_mode: Literal["chained", "kv"] | None = None  # None: chained when stream_video or a session asks
    window_frames: int | None = Field(None, ge=1)  # pixel frames a window denoises (29; Edge 61; kv 29)
    overlap_frames: int | None = Field(None, ge=1)  # frames re-pinned from the previous window (8; Edge 32)
    context_frames: int | None = Field(None, ge=0)  # kv only: committed frames kept (61; 0 keeps all)
    stream_video: bool = False  # each window its own video event, as it is decoded


def noises(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    """Standard-normal tensors of ``shapes`` drawn one after another from one CPU generator
    seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(shape), generator=generator) for shape in shapes]


def is_windowed(spec: GenerateSpec, knobs: VideoKnobs) -> bool:
    """Whether a video request asks for a windowed rollout (a mode, streamed windows or a session)."""
    return knobs.window_mode is not None or knobs.stream_video or spec.session is not None


class ActionVideoKnobs(VideoKnobs):
    """The video routes' fields of a model with action heads: forward dynamics too (the values
    are checked by ``ActionKnobs``)."""

    action_mode: str | None = None
    raw_actions: list[list[float]] | None = None
    domain_name: str | None = None
    action_chunk_size: int | None = None
    resolution_tier: int | None = None


def check_size(width: int, height: int, field: str | None = None) -> None:
    for name, side in (("width", width), ("height", height)):
        if side % SIZE_MULTIPLE or side < SIZE_MULTIPLE or side > MAX_SIDE:
            raise RequestError(field or name, f"{name} must be a positive multiple of {SIZE_MULTIPLE} up to "
                                              f"{MAX_SIDE}, got {side}")


@register
class Cosmos3(ActionRequests, ModelSpec):
    key = "cosmos3"
    tasks = frozenset({"image_generation", "video_generation"})
    video_frame_step = FRAME_STEP
    video_knobs = VideoKnobs
    default_weights = "nvidia/Cosmos3-Nano"
    Knobs = Cosmos3Knobs
    knobs: Cosmos3Knobs
    distilled_sigmas: list[float] | None = None  # the checkpoint's fixed schedule (load_frontend reads it)
    video_needs_image = False  # a request must bring a conditioning image or clip (the i2v distillation)
    sound: SoundLayout | None = None  # the checkpoint's sound pathway (load_frontend reads it)
    video_soundtrack: tuple[int, int] | None = None  # (rate, channels) of the audio the routes mux

    def graph(self) -> Graph:
        dit = Node("dit", "denoise", inputs=("latents", "prompt_ids", "negative_ids", "step_noise", "cond_latents",
                                             "sound_latents", "action_latents"),
                   outputs=("latents", "sound_latents", "action_latents", "action"), ops=("step", "actions"))
        windowed = self.knobs.enable_windowed_video
        vae = Node("vae", "stateless", inputs=("latents", "cond_pixels", *(("window_noise", "tail_pixels") * windowed)),
                   outputs=("frames", "image", "cond_latents", *(("latents", "tail_pixels") * windowed)),
                   ops=("encode", "decode", "decode_image", *(("window_start", "window_decode") * windowed)))
        sound = Node("sound", "stateless", inputs=("sound_latents",), outputs=("waveform",), ops=("decode",))
        walks = [self._walk(mode, extra) for mode in ("t2v", "t2i", "i2v", "v2v")
                 for extra in ("", "_guided", "_fixed")]
        walks += [self._walk(mode, extra, sound=True) for mode in ("t2v", "i2v", "v2v") for extra in ("", "_guided")]
        walks += [self._action_walk(mode, guided, video, sound)
                  for mode in ("policy", "forward_dynamics", "inverse_dynamics") for guided in (False, True)
                  for video in (False, True) for sound in (False, True)
                  if not (video and mode == "forward_dynamics")]
        if windowed:
            walks += windowed_walks()
        chat_nodes, chat_walks = self.chat_graph()
        return Graph.build([dit, vae, sound, *chat_nodes], walks + chat_walks)

    def chat_graph(self) -> tuple[list[Node], list[Walk]]:
        """The reasoner's nodes and walks (Edge only)."""
        return [], []

    @staticmethod
    def _action_walk(mode: str, guided: bool, video: bool, sound: bool = False) -> Walk:
        """``act_<mode>[_video][_guided][_sound]``: encode the observation, denoise the clip and
        the action chunk together (``_sound``: and the sound latents), then emit the actions
        (policy, inverse dynamics; ``_video``: and the decoded clip) or the decoded clip (forward
        dynamics), and with ``_sound`` the decoded soundtrack."""
        audio = ("sound_latents",) if sound else ()
        reads = ("latents", "prompt_ids", *(("negative_ids",) if guided else ()), *audio, "cond_latents",
                 "action_latents")
        encode = Step("vae", "encode", reads="cond_pixels", writes="cond_latents")
        denoise = Loop(Step("dit", "step", reads=reads, writes=("latents", *audio, "action_latents")),
                       max_iters="num_steps", progress=True)
        decode = Step("vae", "decode", reads="latents", writes="frames", emit=Emit("frames", "video"))
        actions = Step("dit", "actions", reads="action_latents", writes="action", emit=Emit("action", "action"))
        out = (decode,) if mode == "forward_dynamics" else (actions, decode) if video else (actions,)
        if sound:
            out += (Step("sound", "decode", reads="sound_latents", writes="waveform", emit=Emit("waveform", "audio")),)
        inputs = tuple(r for r in reads if r != "cond_latents") + ("cond_pixels",)
        name = f"act_{mode}" + ("_video" if video else "") + ("_guided" if guided else "") + ("_sound" if sound else "")
        return Walk(name, Sequential(encode, denoise, *out), inputs=inputs)

    def _walk(self, mode: str, kind: str, sound: bool = False) -> Walk:
        """``mode``: t2v, t2i (one image out), i2v or v2v (the VAE encodes the request's
        ``cond_pixels`` first). ``kind``: "" (no guidance), "_guided" (the negative prompt too)
        or "_fixed" (the distilled checkpoints' fixed-sigma sampler, which reads the request's
        step noise). ``sound``: the ``sound_latents`` denoise beside the video and are decoded
        to its soundtrack (walk ``<mode><kind>_sound``)."""
        extra = {"": (), "_guided": ("negative_ids",), "_fixed": ("step_noise",)}[kind]
        conditioned = mode in ("i2v", "v2v")
        audio = ("sound_latents",) if sound else ()
        reads = ("latents", "prompt_ids", *extra, *audio, *(("cond_latents",) if conditioned else ()))
        decode = [Step("vae", "decode_image", reads="latents", writes="image", emit=Emit("image", "image"))
                  if mode == "t2i" else
                  Step("vae", "decode", reads="latents", writes="frames", emit=Emit("frames", "video"))]
        if sound:
            decode.append(Step("sound", "decode", reads="sound_latents", writes="waveform",
                               emit=Emit("waveform", "audio")))
        denoise = Loop(Step("dit", "step", reads=reads, writes=("latents", *audio)), max_iters="num_steps",
                       progress=True)
        name = mode + kind + ("_sound" if sound else "")
        if not conditioned:
            return Walk(name, Sequential(denoise, *decode), inputs=reads)
        encode = Step("vae", "encode", reads="cond_pixels", writes="cond_latents")
        inputs = (*reads[:-1], "cond_pixels")
        return Walk(name, Sequential(encode, denoise, *decode), inputs=inputs)

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Cosmos3Checkpoint:
        return Cosmos3Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        ckpt.check_variant()
        self.prompt = ckpt.prompt()
        tower = ckpt.transformer_config()
        self.latent_channels = tower.latent_channel
        self.distilled_sigmas = ckpt.distilled_sigmas()
        if ckpt.has_sound():
            self.sound = SoundLayout.of(ckpt.sound_tokenizer_config(), int(tower.sound_dim))
            self.video_soundtrack = (self.sound.sampling_rate, self.sound.channels)
        self.action_dim = tower.action_dim if tower.action_gen and self.distilled_sigmas is None else None
        self.action_domains = tower.num_embodiment_domains
        self.action_chunk = self.knobs.action_chunk_size if self.action_dim else 0  # /generate's rows of an action
        if self.action_dim and self.knobs.domain_name is not None:
            self._domain(self.knobs.domain_name)  # a bad deployment domain fails startup, not a request
        if self.knobs.enable_windowed_video and self.distilled_sigmas is None:
            log.warning("%s: %s", self.key, KV_WARNING)

    def _steps_and_scale(self, steps: int | None, scale: float | None) -> tuple[int, float]:
        if self.distilled_sigmas is not None:  # the schedule is the checkpoint's, guidance baked in
            fixed = len(self.distilled_sigmas)
            if steps not in (None, fixed):
                raise RequestError("num_inference_steps", f"model {self.key!r} is distilled to {fixed} steps "
                                                          f"(leave it unset or {fixed})")
            if scale not in (None, 1.0):
                raise RequestError("guidance_scale", f"model {self.key!r} has guidance baked in (leave it unset or 1)")
            return fixed, 1.0
        steps = self.knobs.num_inference_steps if steps is None else steps
        if not 1 <= steps <= MAX_STEPS:
            raise RequestError("num_inference_steps", f"must be between 1 and {MAX_STEPS}")
        scale = self.knobs.guidance_scale if scale is None else scale
        if not (math.isfinite(scale) and scale >= 1):
            raise RequestError("guidance_scale", "must be a number >= 1 (1 turns guidance off)")
        return steps, scale

    def _request(self, prompt: str, negative: str, *, width: int, height: int, num_frames: int, fps: float,
                 steps: int, scale: float, seed: int | None, params: dict, image: bool,
                 condition: tuple[str, torch.Tensor] | None = None, sound: bool = False) -> WalkRequest:
        """``image``: an image request (the ``t2i`` walks, one encoded image out); otherwise a
        video (``t2v``: raw frames, one frame for ``num_frames`` 1). ``condition``: ("i2v" or
        "v2v", the conditioning pixels ``[3, F, H, W]``). ``sound``: a soundtrack too (the
        ``*_sound`` walks; the checks are the caller's)."""
        meta = dict(num_frames=num_frames, height=height, width=width, fps=fps)
        ids = self.prompt.ids(prompt, **meta)
        shape = (1, self.latent_channels, (num_frames - 1) // FRAME_STEP + 1, height // SIZE_MULTIPLE,
                 width // SIZE_MULTIPLE)
        seed = seed if seed is not None else torch.seed() % (1 << 31)
        params = {"num_steps": steps, "num_frames": num_frames, "fps": fps, **params}
        kind = ""
        if self.distilled_sigmas is not None:  # the starting latents, then one noise draw a step
            noise = _NOISE.submit(draws, shape[1:], seed, steps + 1)
            inputs = {"prompt_ids": ids, "latents": _NOISE.submit(lambda: noise.result()[0].contiguous()),
                      "step_noise": _NOISE.submit(lambda: noise.result()[1:].contiguous())}
            kind = "_fixed"
        elif sound and self.sound is not None:  # the pipeline's draws: the video's noise, then the sound's
            noise = _NOISE.submit(noises, [shape[1:], self.sound.latent_shape(num_frames, fps)], seed)
            inputs = {"prompt_ids": ids, "latents": _NOISE.submit(lambda: noise.result()[0]),
                      "sound_latents": _NOISE.submit(lambda: noise.result()[1])}
            params["audio_samples"] = self.sound.samples(num_frames, fps)
        else:
            inputs = {"prompt_ids": ids,
                      "latents": FlowMatchEuler.initial_noise_soon(shape, seed, finish=lambda n: n[0])}
        if scale > 1:
            inputs["negative_ids"] = self.prompt.ids(negative, negative=True, **meta)
            params["guidance_scale"] = scale
            kind = "_guided"
        mode = "t2i" if image else "t2v"
        if condition is not None:
            mode, inputs["cond_pixels"] = condition
        walk = mode + kind + ("_sound" if "sound_latents" in inputs else "")
        return WalkRequest(walk, inputs, params, prompt_tokens=len(ids))

    def check_video(self, spec: GenerateSpec) -> tuple[VideoKnobs, int, float, tuple[str, torch.Tensor] | None]:
        """The request's checks, each a ``RequestError`` naming the field, before queueing; the
        last item is the conditioning (mode and pixels) of an i2v or v2v request."""
        if set(spec.output_modalities) not in ({"video"}, {"video", "audio"}):
            raise RequestError("output_modalities", f"model {self.key!r} outputs a video (with audio when "
                                                    "enable_sound is set) or an image")
        knobs = VideoKnobs.parse(spec.model_kwargs)
        if knobs.enable_sound:
            self._check_sound()
        if not spec.text.strip():
            raise RequestError("prompt", "must not be empty")
        if len(spec.files) > 1:
            raise RequestError("image", f"a clip takes one conditioning image or video, got {len(spec.files)} files")
        if self.video_needs_image and not spec.files:
            raise RequestError("image", f"model {self.key!r} is distilled for image-to-video: send the image "
                                        "(or a clip to continue)")
        check_size(knobs.width, knobs.height)
        if knobs.width * knobs.height > self.knobs.max_image_area:
            raise RequestError("width", f"{knobs.width}x{knobs.height} is over max_image_area "
                                        f"({self.knobs.max_image_area} pixels a frame)")
        # A clip starts on a lone frame (its first latent frame decodes to one, each later one to
        # four); a resumed session's frames go on from its last window, four a latent frame, so a
        # resume may also ask for 4k (whole windows then join the next resume with no frame cut).
        resume = spec.session is not None and spec.session.resume
        if (knobs.num_frames - 1) % FRAME_STEP and not (resume and knobs.num_frames % FRAME_STEP == 0):
            low = (knobs.num_frames - 1) // FRAME_STEP * FRAME_STEP + 1
            more = f" or, resuming, {FRAME_STEP}k" if resume else ""
            raise RequestError("num_frames", f"must be {FRAME_STEP}k + 1 (1, 5, 9, ...){more}, got "
                                             f"{knobs.num_frames} (nearest: {low} or {low + FRAME_STEP})")
        if knobs.width * knobs.height * knobs.num_frames > self.knobs.max_video_pixels and not is_windowed(spec, knobs):
            raise RequestError("num_frames", f"{knobs.width}x{knobs.height}x{knobs.num_frames} is over "
                                             f"max_video_pixels ({self.knobs.max_video_pixels} pixels)")
        steps, scale = self._steps_and_scale(knobs.num_inference_steps, knobs.guidance_scale)
        condition = self._condition(spec.files[0], knobs) if spec.files else None
        if is_windowed(spec, knobs):
            plan_windowed(self, spec, knobs, condition)
        else:
            for name in ("window_frames", "overlap_frames", "context_frames"):
                if getattr(knobs, name) is not None:
                    raise RequestError(name, "applies to windowed rollouts: set window_mode (or stream_video)")
        return knobs, steps, scale, condition

    def _check_sound(self) -> None:
        """``enable_sound`` is served here (video and action requests alike), or a 400 naming it."""
        if self.sound is None:
            raise RequestError("enable_sound", f"model {self.key!r}: this checkpoint has no sound pathway "
                                               "(no sound_tokenizer/ or a tower without sound_gen)")
        if self.distilled_sigmas is not None:
            raise RequestError("enable_sound", f"model {self.key!r}: sound is served on the UniPC sampler only, "
                                               "not the distilled fixed-sigma one")

    def _condition(self, file: tuple[str, bytes], knobs: VideoKnobs) -> tuple[str, torch.Tensor]:
        """An i2v request's image or a v2v request's clip as conditioning pixels."""
        from mstar.media.images import ImageError, decode_image

        name, data = file
        latent_frames = (knobs.num_frames - 1) // FRAME_STEP + 1
        image_error = None
        if name != "video":
            try:
                image = decode_image(data, field="image")
            except ImageError as err:
                if err.status == 413:
                    raise RequestError(err.field, err.message, err.status) from None
                image_error = err
            else:
                if knobs.num_frames == 1:
                    raise RequestError("num_frames", "image-to-video makes a clip: num_frames must be 5 or more "
                                                     "(4k + 1)")
                resize = knobs.conditioning_resize or self.knobs.conditioning_resize
                return "i2v", image_pixels(image, knobs.width, knobs.height, resize)
        field = "video" if name == "video" else "image"
        frames = self._clip(data, knobs.condition_latent_frames, field, image_error)
        if knobs.num_frames == 1:
            raise RequestError("num_frames", "video-to-video makes a clip: num_frames must be 5 or more (4k + 1)")
        if knobs.condition_latent_frames >= latent_frames:
            raise RequestError("condition_latent_frames",
                               f"must be below the clip's {latent_frames} latent frames (num_frames "
                               f"{knobs.num_frames}); {knobs.condition_latent_frames} leaves none to generate")
        return "v2v", video_pixels(frames, knobs.width, knobs.height, knobs.condition_latent_frames)

    @staticmethod
    def _clip(data: bytes, latent_frames: int, field: str, image_error: Exception | None):
        """The clip's first ``1 + 4 (latent_frames - 1)`` frames (PyAV), ``uint8 [N, h, w, 3]``."""
        try:
            from mstar.media.video import VideoDecodeError, decode_frames, probe_video
        except ModuleNotFoundError as err:  # PyAV missing: only video input is refused
            raise RequestError(field, f"video input needs PyAV ({err})") from None
        try:
            count = probe_video(data)[0]
            if count < 1:
                raise RequestError(field, "the video has no frames")
            return decode_frames(data, list(range(min(count, condition_length(latent_frames)))))
        except (VideoDecodeError, ModuleNotFoundError) as err:
            detail = f"not an image ({image_error.message}) nor a readable video ({err})" if image_error else str(err)
            raise RequestError(field, detail) from None

    def prepare_video(self, spec: GenerateSpec) -> WalkRequest:
        knobs, steps, scale, condition = self.check_video(spec)
        if is_windowed(spec, knobs):
            return prepare_windowed(self, spec, knobs, steps, scale, condition)
        return self._request(spec.text, knobs.negative_prompt, width=knobs.width, height=knobs.height,
                             num_frames=knobs.num_frames, fps=float(knobs.fps), steps=steps, scale=scale,
                             seed=knobs.seed, params={}, image=False, condition=condition, sound=knobs.enable_sound)

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        if not spec.prompt.strip():
            raise RequestError("prompt", "must not be empty")
        if spec.images:
            raise RequestError("image", f"model {self.key!r} generates from text only; it does not edit images")
        check_size(spec.width, spec.height, "size")
        if spec.width * spec.height > self.knobs.max_image_area:
            raise RequestError("size", f"{spec.width}x{spec.height} is over max_image_area "
                                       f"({self.knobs.max_image_area} pixels)")
        steps, scale = self._steps_and_scale(spec.num_inference_steps, spec.guidance_scale)
        seed = None if spec.seed is None else spec.seed + index
        negative = str(spec.model_kwargs.get("negative_prompt", ""))
        kwargs = {k: v for k, v in spec.model_kwargs.items() if k != "negative_prompt"}
        return self._request(spec.prompt, negative, width=spec.width, height=spec.height, num_frames=1, fps=24.0,
                             steps=steps, scale=scale, seed=seed, params=output_params(kwargs), image=True)

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) == {"image"}:
            return self.prepare_image(ImageGenerateKnobs.parse(spec.model_kwargs).image_spec(spec))
        if "action" in spec.output_modalities or spec.model_kwargs.get("action_mode") is not None:
            return self.prepare_action(spec)
        return self.prepare_video(spec)

    def output_stream(self, request: WalkRequest, stop: list[str]):
        if request.walk.startswith("t2i"):
            return ImageStream.for_request(request)
        if request.walk.startswith(("act_policy", "act_inverse")):
            return ActionChunk(request.params.get("audio_samples"))
        if request.walk.endswith("_sound"):
            return SoundVideoStream(request.params["audio_samples"])
        if request.walk.startswith("windowed"):
            return WindowedVideo(bool(request.params.get("stream_video")))
        return VideoFrames()

    def parallel_dims(self) -> dict:
        """The ``dit`` node splits both experts' heads and KV heads over ``tp_size`` (and ``tp_size
        x sp_size`` with Ulysses over the packed media rows) and their MLP width over ``tp_size``.
        The VAE, the sound decoder and the Edge reasoner (``llm``, ``vision``) run whole: placement
        refuses a split of them. Row counts need no check: the sequence slices may be uneven."""
        from mstar.distributed.dims import ParallelDims

        c = self.checkpoint().transformer_config()
        heads = {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads}
        return {"dit": ParallelDims(tensor={**heads, "intermediate_size": c.intermediate_size}, sequence=heads)}

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.cosmos3.engine import cosmos3_engines

        ckpt = self.checkpoint()
        ckpt.check_variant()
        return cosmos3_engines(ckpt, self.knobs, self.config, set(nodes), device)


@register
class Cosmos3Edge(Cosmos3, ReasonerChat):
    """Cosmos3-Edge (4B, dense Nemotron backbone): the same declaration; the tower's config
    says ``relu2``. It also serves the reasoner (``mstar.model.cosmos3.chat``): image and video
    chat on the tower's understanding expert (``llm``, sharing the ``dit`` node's tower when
    both are on one worker) and the vision tower (``vision``)."""

    key = "cosmos3_edge"
    default_weights = "nvidia/Cosmos3-Edge"
    tasks = Cosmos3.tasks | {"chat"}
    input_modalities = frozenset({"text", "image", "video"})

    def load_frontend(self) -> None:
        from mstar.model.cosmos3.reasoner import Cosmos3Vision

        super().load_frontend()
        ckpt = self.checkpoint()
        self.tokenizer = self.prompt.tokenizer
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_token_ids = self.stop_ids(None, *([end] if isinstance(end, int) and end >= 0 else []))
        if (ckpt.root / "reasoner" / "config.json").exists():
            self.reasoner_config = Cosmos3Vision.read_config(ckpt.root, ckpt.transformer_config().hidden_size)

    def chat_graph(self):
        return ReasonerChat.chat_graph(self)

    def output_stream(self, request: WalkRequest, stop: list[str]):
        if request.walk in ("chat", "chat_vision"):
            return ReasonerChat.output_stream(self, request, stop)
        return super().output_stream(request, stop)


@register
class Cosmos3Super(Cosmos3):
    """Cosmos3-Super (64B): the same declaration, a larger tower (split over GPUs by the ``dit``
    node group's ``tp_size`` / ``sp_size``, ``configs/cosmos3_super_tp2.yaml``)."""

    key = "cosmos3_super"
    default_weights = "nvidia/Cosmos3-Super"


@register
class Cosmos3SuperT2I4Step(Cosmos3):
    """Cosmos3-Super distilled to 4 steps for text-to-image: guidance baked into the weights,
    the fixed-sigma stochastic sampler its checkpoint lists (``distilled_sigmas``)."""

    key = "cosmos3_super_t2i_4step"
    tasks = frozenset({"image_generation"})
    default_weights = "nvidia/Cosmos3-Super-Text2Image-4Step"


@register
class Cosmos3SuperI2V4Step(Cosmos3):
    """Cosmos3-Super distilled to 4 steps for image-to-video: guidance baked in, the fixed-sigma
    sampler, the conditioned frames re-anchored after every stochastic step. Every request
    brings an image (or a clip, as video-to-video)."""

    key = "cosmos3_super_i2v_4step"
    tasks = frozenset({"video_generation"})
    default_weights = "nvidia/Cosmos3-Super-Image2Video-4Step"
    video_needs_image = True


@register
class Cosmos3Droid(Cosmos3):
    """Cosmos3-Nano's action-policy fine-tune for the DROID platform (``droid_lerobot``, 10-wide
    actions): the action modes on the Nano tower with action heads; its config serves the released
    policy defaults (4 steps, guidance 3)."""

    key = "cosmos3_droid"
    tasks = frozenset({"video_generation"})
    video_knobs = ActionVideoKnobs
    default_weights = "nvidia/Cosmos3-Nano-Policy-DROID"


@register
class Cosmos3EdgeDroid(Cosmos3):
    """Cosmos3-Edge's action-policy fine-tune for DROID: the Edge tower with action heads."""

    key = "cosmos3_edge_droid"
    tasks = frozenset({"video_generation"})
    video_knobs = ActionVideoKnobs
    default_weights = "nvidia/Cosmos3-Edge-Policy-DROID"
