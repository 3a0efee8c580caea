"""``POST /v1/videos/generations``: a prompt (and optionally one image, for image-to-video) to
a video, answered like the image route: ``{"created", "data": [{"b64_json"}]}`` holding an
H.264 mp4 (``mstar.media.video``), or with ``response_format="png_frames"`` one PNG per frame.

The body's fields map onto the video family's ``model_kwargs``: ``size`` "WxH" -> ``width`` /
``height``; ``num_frames``, or ``seconds`` x ``fps`` rounded to the nearest count of the form
4k + 1 (the frame counts the Wan VAE codes); ``image`` (a data URI, base64, or an http(s) URL
with MSTAR_ALLOW_REMOTE=1) becomes the request's one file, as does ``video`` (a clip to continue,
for a model whose video knobs say ``takes_video``; its file is named "video"); ``seed``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``conditioning_resize``,
``condition_latent_frames``, ``enable_sound`` (a soundtrack on request, muxed as AAC) and
the forward-dynamics fields (``action_mode``, ``raw_actions``, ``domain_name``,
``action_chunk_size``, ``resolution_tier``) pass through (a 400 where the model does not take
them). The family checks them before queueing; its refusals are renamed to this body's fields (``width``
-> ``size``, ``num_frames`` -> ``seconds`` when the count came from seconds), so a 400 names
what the client sent. The frames come back raw from the model; the mp4 is written here, in a thread, never in the model.

A windowed rollout (``window_mode``, ``window_frames``, ``overlap_frames``, ``context_frames``,
``stream_video``, where the model takes them; the session fields ``session_id``, ``resume_session``,
``end_session`` and ``session_timeout_s`` as ``/generate``'s) with ``stream_video`` answers an
NDJSON body instead: one line ``{"type": "video", "index": i, "b64_json": mp4}`` a window as it
is decoded (``png_frames``: ``"frames"``, a PNG list), closed by ``{"type": "done"}`` (an error after the start: an
``{"error"}`` line).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, ValidationError

from mstar.contract import GenerateSpec, RequestError, SessionSpec
from mstar.media.video import encode_mp4
from mstar.server.bodies import fetch_all
from mstar.server.errors import APIError, exception_response, in_band_error, validation_error_response
from mstar.server.schemas import SessionFields, json_body_openapi, new_id, now
from mstar.server.served import backend_of, resolve_model
from mstar.server.streaming import Tally, start_events, stream_response, unless_disconnected, walk_events

MAX_PROMPT_CHARS = 4000
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_VIDEO_BYTES = 64 * 1024 * 1024  # a conditioning clip, as /generate's per-file cap
DEFAULT_FPS = 24  # Wan2.2's
FRAME_STEP = 4  # frame counts are 4k + 1
TASK = "video_generation"
RESPONSE_FORMATS = ("b64_json", "png_frames")


class VideoRequest(SessionFields):
    """The body of /v1/videos/generations (with the session fields: windowed rollouts)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    size: str | None = Field(None, description="WxH, e.g. 1280x704 (default: the model's)")
    seconds: float | None = Field(None, gt=0, le=600, description="length; frames = seconds x fps, to 4k + 1")
    num_frames: int | None = Field(None, ge=1, description="instead of seconds; of the form 4k + 1")
    fps: int | None = Field(None, ge=1, le=240, description=f"playback rate (default {DEFAULT_FPS})")
    image: str | None = Field(None, description="image-to-video: a data URI, base64 or URL")
    video: str | None = Field(None, description="video-to-video: a clip (mp4) as a data URI, base64 or URL")
    conditioning_resize: str | None = Field(None, description="image-to-video: cover (default) or stretch")
    condition_latent_frames: int | None = Field(None, ge=1, description="video-to-video: latent frames kept")
    enable_sound: bool | None = Field(None, description="a soundtrack (AAC in the mp4), where the model opts in")
    seed: int | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=100)
    guidance_scale: float | None = Field(None, ge=1.0, allow_inf_nan=False)
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    action_mode: str | None = Field(None, description="forward_dynamics: roll the image out under raw_actions "
                                                      "(a model with action heads)")
    raw_actions: list[list[float]] | None = Field(None, description="forward dynamics: [T, raw_action_dim]")
    domain_name: str | None = Field(None, description="forward dynamics: the embodiment (e.g. droid_lerobot)")
    action_chunk_size: int | None = Field(None, ge=1, description="forward dynamics: actions (frames - 1)")
    resolution_tier: int | None = Field(None, description="forward dynamics: the canvas tier (256, 480, 704, 720)")
    response_format: str = Field("b64_json", description="b64_json (an mp4) or png_frames")
    window_mode: str | None = Field(None, description="a windowed rollout: chained or kv (experimental)")
    window_frames: int | None = Field(None, ge=1, description="windowed: pixel frames a window denoises")
    overlap_frames: int | None = Field(None, ge=1, description="windowed: frames re-pinned from the last window")
    context_frames: int | None = Field(None, ge=0, description="windowed kv: committed frames kept (0: all)")
    stream_video: bool | None = Field(None, description="windowed: an NDJSON body, one video line a window")
    user: str | None = None


def frames_for(seconds: float, fps: int, step: int = FRAME_STEP) -> int:
    """``seconds`` at ``fps`` as a frame count of the form ``step * k + 1`` (the model's: 4 for
    Wan2.2, 8 for LTX-2.5), the nearest one (ties up)."""
    return step * int(np.floor((seconds * fps - 1) / step + 0.5)) + 1 if seconds * fps > 1 else 1


def parse_video_size(size: str) -> tuple[int, int]:
    width, sep, height = size.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or not int(height):
        raise RequestError("size", f"must be WIDTHxHEIGHT with positive integers, e.g. 1280x704; got {size!r}")
    return int(width), int(height)


def model_kwargs_of(req: VideoRequest, backend: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The family's ``model_kwargs`` for ``req`` on ``backend`` (its frame step and default
    size and length, where it says them), and the family's field names -> the body's."""
    frame_step = getattr(backend, "video_frame_step", FRAME_STEP)
    fps = req.fps or DEFAULT_FPS
    kwargs: dict[str, Any] = {"fps": fps}
    renames = {"width": "size", "height": "size", "files": "image", "output_modalities": "model"}
    if req.size is not None:
        kwargs["width"], kwargs["height"] = parse_video_size(req.size)
        if req.response_format == "b64_json" and (kwargs["width"] % 2 or kwargs["height"] % 2):
            raise RequestError("size", f"an mp4 (H.264, yuv420p) needs an even width and height, got {req.size}")
    if req.num_frames is not None and req.seconds is not None:
        raise RequestError("num_frames", "give seconds or num_frames, not both")
    if req.num_frames is not None:
        kwargs["num_frames"] = req.num_frames
    elif req.seconds is not None:
        kwargs["num_frames"] = frames_for(req.seconds, fps, frame_step)
        renames["num_frames"] = "seconds"
    for name in ("seed", "num_inference_steps", "guidance_scale", "negative_prompt", "conditioning_resize",
                 "condition_latent_frames", "enable_sound", "window_mode", "window_frames", "overlap_frames",
                 "context_frames", "stream_video", "action_mode", "raw_actions", "domain_name", "action_chunk_size",
                 "resolution_tier"):
        if (value := getattr(req, name)) is not None:
            kwargs[name] = value
    if req.response_format not in RESPONSE_FORMATS:
        raise RequestError("response_format", f"must be one of {', '.join(RESPONSE_FORMATS)}")
    knobs = getattr(backend, "video_knobs", None)
    if knobs is not None:  # the model's own defaults, and a 400 for a field it does not take
        for name in ("width", "height", "num_frames"):
            kwargs.setdefault(name, knobs.model_fields[name].default)
        for name in kwargs:
            if name not in knobs.model_fields:
                raise RequestError(renames.get(name, name), f"model {backend.model_id!r} does not take it")
    return kwargs, renames


def frames_of(data: bytes, width: int, height: int) -> np.ndarray:
    """A ``video`` output's raw bytes (frame-major uint8 RGB) as ``[F, H, W, 3]``."""
    frame = width * height * 3
    if not data or len(data) % frame:
        raise APIError(500, f"the model's video output ({len(data)} bytes) is not whole {width}x{height} frames")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, height, width, 3)


def png_frames(frames: np.ndarray) -> list[bytes]:
    from PIL import Image

    out = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


@dataclass
class Video:
    """A video model's output: ``frames`` ``uint8 [F, H, W, 3]`` and, from a model that makes
    sound with them, ``audio`` float32 ``[channels, samples]`` at ``sample_rate``."""

    frames: np.ndarray
    audio: np.ndarray | None = None
    sample_rate: int = 0

    def mp4(self, fps: float) -> bytes:
        return encode_mp4(self.frames, fps, audio=self.audio, sample_rate=self.sample_rate or 48000)


def video_spec(backend: Any, request_id: str, prompt: str, files: list, kwargs: dict[str, Any],
               session: SessionSpec | None = None) -> GenerateSpec:
    """The ``/generate`` request of a video route: video, and audio where the model makes it;
    ``session``: the world-state session it starts or resumes (a windowed rollout's)."""
    modalities = ["video", "audio"] if getattr(backend, "video_soundtrack", None) else ["video"]
    return GenerateSpec(request_id=request_id, text=prompt, files=files, output_modalities=modalities,
                        model_kwargs=kwargs, session=session)


async def run_video(backend: Any, spec: GenerateSpec, renames: dict[str, str], request: Request | None = None,
                    on_progress: Callable[[int, int], None] | None = None) -> Video:
    """The spec's video; a family refusal is re-raised under the body's field. ``on_progress(k,
    n)`` hears each denoising step's end."""
    try:
        first, events = await start_events(lambda: backend.generate(spec), request)
    except RequestError as exc:
        field = renames.get(exc.field, exc.field)
        raise RequestError(field, exc.message, exc.status) from None
    out = Tally()
    async with aclosing(walk_events(first, events, out)) as walk:
        async for event in walk:
            if event.progress is not None and on_progress is not None:
                on_progress(*event.progress)
    kwargs = spec.model_kwargs
    frames = frames_of(bytes(out.data.get("video", b"")), kwargs.get("width", 1280), kwargs.get("height", 704))
    soundtrack = getattr(backend, "video_soundtrack", None)
    if "audio" not in out.data or not soundtrack:
        return Video(frames)
    rate, channels = soundtrack
    pcm = np.frombuffer(bytes(out.data["audio"]), dtype="<i2").reshape(-1, channels)
    return Video(frames, (pcm.T / 32767.0).astype(np.float32), rate)


async def video_generations(request: Request) -> Response:
    try:
        body = await request.json()
    except Exception:
        return exception_response(RequestError("body", "must be a JSON object"))
    try:
        req = VideoRequest.model_validate(body)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    try:
        resolve_model(request, req.model, TASK)
        kwargs, renames = model_kwargs_of(req, backend_of(request))
        session = req.session()
        files = []
        if req.image is not None:
            [image] = await fetch_all([(req.image, "image", MAX_IMAGE_BYTES)])
            files.append(("image", image))
        if req.video is not None:
            if not getattr(getattr(backend_of(request), "video_knobs", None), "takes_video", False):
                raise RequestError("video", f"model {backend_of(request).model_id!r} does not take a video")
            if req.image is not None:
                raise RequestError("video", "give image or video, not both")
            [clip] = await fetch_all([(req.video, "video", MAX_VIDEO_BYTES)])
            files.append(("video", clip))
            renames["files"] = "video"
    except Exception as exc:
        return exception_response(exc)
    backend = backend_of(request)
    spec = video_spec(backend, new_id("video"), req.prompt, files, kwargs, session)
    if req.stream_video:
        try:
            first, events = await start_events(lambda: backend.generate(spec), request)
        except RequestError as exc:
            return exception_response(RequestError(renames.get(exc.field, exc.field), exc.message, exc.status))
        except Exception as exc:
            return exception_response(exc)
        return stream_response(_window_lines(first, events, kwargs, req.response_format), "application/x-ndjson")

    async def complete() -> Response:
        try:
            video = await run_video(backend, spec, renames, request)
            if req.response_format == "png_frames":
                items = await anyio.to_thread.run_sync(png_frames, video.frames)
            else:
                items = [await anyio.to_thread.run_sync(video.mp4, kwargs["fps"])]
        except Exception as exc:
            return exception_response(exc)
        data = [{"b64_json": base64.b64encode(item).decode()} for item in items]
        return JSONResponse({"created": now(), "data": data})

    return await unless_disconnected(request, complete)


async def _window_lines(first, events, kwargs: dict[str, Any], response_format: str) -> AsyncIterator[str]:
    """A streamed windowed rollout: one NDJSON line a window (an mp4, or its PNG frames), then
    ``done``."""
    index = 0
    try:
        async with aclosing(walk_events(first, events, Tally())) as walk:
            async for event in walk:
                if event.modality != "video" or not event.data:
                    continue
                frames = frames_of(event.data, kwargs["width"], kwargs["height"])
                if response_format == "png_frames":
                    pngs = await anyio.to_thread.run_sync(png_frames, frames)
                    line = {"frames": [base64.b64encode(p).decode() for p in pngs]}
                else:
                    mp4 = await anyio.to_thread.run_sync(encode_mp4, frames, kwargs["fps"])
                    line = {"b64_json": base64.b64encode(mp4).decode()}
                yield json.dumps({"type": "video", "index": index, **line}) + "\n"
                index += 1
        yield json.dumps({"type": "done", "windows": index}) + "\n"
    except Exception as exc:
        yield json.dumps(in_band_error(exc)) + "\n"


def video_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/videos/generations", video_generations, methods=["POST"],
                         openapi_extra=json_body_openapi(VideoRequest))
    return router
