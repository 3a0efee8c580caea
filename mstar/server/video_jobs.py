"""OpenAI's video job API over the same backend: ``POST /v1/videos`` (multipart, as the
official client sends it, or JSON: ``prompt``, ``model``, ``seconds``, ``size``,
``input_reference`` an image file; plus the M* extras of /v1/videos/generations) queues a
job and answers its ``video`` object at once; ``GET /v1/videos/{id}`` polls it,
``GET /v1/videos/{id}/content`` downloads the mp4 (``variant=video`` only: thumbnails and
spritesheets are a 400), ``GET /v1/videos`` lists jobs newest first with OpenAI's cursor
(``after``, ``limit``, ``order``; ``has_more``, ``last_id``) and ``DELETE /v1/videos/{id}``
forgets one, cancelling it if it still runs (which closes its backend stream, so the runtime
frees the request's slot and state as on a client disconnect). The job's ``status`` is queued,
then in_progress (handed to the backend), then completed or failed; ``progress`` follows the
denoising steps (99 at most until the mp4 exists, then 100).

Jobs run as tasks on the server's event loop and live in a bounded in-memory store
(``VideoJobOptions``: ``max_jobs``, ``ttl_s``): a finished job is dropped ``ttl_s`` after it
finished (its ``expires_at``), and a new job past ``max_jobs`` first evicts the oldest finished
one, else is a 429. The body's own rules (size syntax, seconds or num_frames, limits) and what
the model refuses (a size not a multiple of 32, a frame count over its limits, an image that
does not decode: the backend's ``check_video``, run before queueing) are 400s naming the
body's field before a job exists; a refusal that still comes from the walk fails the job with
``error.code`` "invalid_request".

A windowed rollout (a model that takes them: ``window_mode``, ``window_frames``,
``overlap_frames``, ``context_frames``) runs as a job like any clip: its content is the one mp4
of the whole rollout (``stream_video`` is a 400 here). The session fields (``session_id``,
``resume_session``, ``end_session``, ``session_timeout_s``) start or continue a world-state
session as on ``/generate``; the session book answers when the job is handed to the backend,
so a busy (409) or gone (410) session fails the job (``error.code`` "invalid_request", the
message naming ``session_id``): resume a session once the job before it has completed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import UploadFile

from mstar.contract import GenerateSpec, RequestError
from mstar.server.bodies import capped_form
from mstar.server.errors import APIError, exception_response, validation_error_response
from mstar.server.options import VideoJobOptions
from mstar.server.schemas import form_body_openapi, new_id
from mstar.server.served import backend_of, resolve_model
from mstar.server.video_routes import MAX_IMAGE_BYTES, TASK, VideoRequest, model_kwargs_of, run_video, video_spec

log = logging.getLogger(__name__)

_FORM_FIELDS = ("prompt", "model", "seconds", "size", "num_frames", "fps", "seed", "num_inference_steps",
                "guidance_scale", "negative_prompt", "user", "conditioning_resize", "condition_latent_frames",
                "enable_sound", "window_mode", "window_frames", "overlap_frames", "context_frames", "session_id",
                "resume_session", "end_session", "session_timeout_s")
MAX_LIST = 100


class VideoJobForm(BaseModel):
    """The text fields of POST /v1/videos (the image is the file part ``input_reference``)."""

    prompt: str
    model: str | None = None
    seconds: str | None = Field(None, description="length in seconds; frames = seconds x fps, to 4k + 1")
    size: str | None = Field(None, description="WxH, e.g. 1280x704 (default: the model's)")
    num_frames: int | None = Field(None, description="instead of seconds; of the form 4k + 1")
    fps: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    window_mode: str | None = Field(None, description="a windowed rollout: chained or kv (experimental)")
    window_frames: int | None = Field(None, description="windowed: pixel frames a window denoises")
    overlap_frames: int | None = Field(None, description="windowed chained: frames re-pinned from the last window")
    context_frames: int | None = Field(None, description="windowed kv: committed frames kept (0: all)")
    session_id: str | None = Field(None, description="windowed: names a world-state session the rollout keeps")
    resume_session: bool | None = Field(None, description="continue the named session (a 410 fails the job)")
    end_session: bool | None = Field(None, description="drop the named session's state once the job is done")
    session_timeout_s: float | None = Field(None, description="seconds the idle session is kept")


@dataclass
class Job:
    id: str
    created_at: int
    model: str
    prompt: str
    size: str
    seconds: str
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None
    mp4: bytes | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    finished_at: float | None = None

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "video", "created_at": self.created_at, "status": self.status,
                "progress": self.progress, "model": self.model, "prompt": self.prompt, "size": self.size,
                "seconds": self.seconds, "completed_at": self.completed_at, "expires_at": self.expires_at,
                "error": self.error, "remixed_from_video_id": None}


class VideoJobs:
    """The bounded store of video jobs (one per app)."""

    def __init__(self, options: VideoJobOptions) -> None:
        self.options = options
        self.jobs: dict[str, Job] = {}  # in creation order

    def expire(self) -> None:
        moment = time.time()
        for job_id in [j.id for j in self.jobs.values()
                       if j.finished_at is not None and moment - j.finished_at >= self.options.ttl_s]:
            del self.jobs[job_id]

    def admit(self, job: Job) -> None:
        self.expire()
        if len(self.jobs) >= self.options.max_jobs:
            finished = [j for j in self.jobs.values() if j.finished_at is not None]
            if not finished:
                raise APIError(429, f"{self.options.max_jobs} video jobs are running; try again later",
                               None, "queue_full")
            del self.jobs[finished[0].id]
        self.jobs[job.id] = job

    def get(self, job_id: str) -> Job:
        self.expire()
        job = self.jobs.get(job_id)
        if job is None:
            raise APIError(404, f"no video job {job_id!r} (unknown, deleted or expired)", "video_id", "not_found")
        return job

    def finish(self, job: Job, status: str) -> None:
        job.status, job.finished_at = status, time.time()
        job.completed_at = int(job.finished_at)
        job.expires_at = int(job.finished_at + self.options.ttl_s)


def _jobs(request: Request) -> VideoJobs:
    """The app's job store, once the served model is known to make video (else a 400 naming ``model``)."""
    resolve_model(request, None, TASK)
    return request.app.state.video_jobs


async def _read_body(request: Request) -> tuple[dict[str, Any], bytes | None]:
    """The job's fields and its reference image, from multipart or JSON."""
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            body = await request.json()
        except Exception:
            raise RequestError("body", "must be a JSON object") from None
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        return body, None
    async with capped_form(request, max_bytes=MAX_IMAGE_BYTES + 1024 * 1024, field="input_reference",
                           max_files=1) as form:
        fields: dict[str, Any] = {}
        for name, value in form.multi_items():
            if name == "input_reference":
                continue
            if name not in _FORM_FIELDS:
                raise RequestError(name, "is not a field of this route")
            if not isinstance(value, str):
                raise RequestError(name, "must be a text field, not a file")
            fields[name] = value
        image = None
        upload = form.get("input_reference")
        if upload is not None:
            if not isinstance(upload, UploadFile):
                raise RequestError("input_reference", "must be an image file")
            image = await upload.read(MAX_IMAGE_BYTES + 1)
            if len(image) > MAX_IMAGE_BYTES:
                raise RequestError("input_reference", f"is over the limit of {MAX_IMAGE_BYTES} bytes", 413)
    return fields, image


async def create_video(request: Request) -> Response:
    try:
        fields, image = await _read_body(request)
        for name in ("image", "video", "response_format"):  # /v1/videos/generations' fields, not this route's
            if name in fields:
                raise RequestError(name, "is not a field of this route (the reference image is input_reference)")
        if "stream_video" in fields:
            raise RequestError("stream_video", "a job's content is one mp4 of the whole rollout; stream windows "
                                               "on /v1/videos/generations")
        req = VideoRequest.model_validate(fields)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except Exception as exc:
        return exception_response(exc)
    try:
        model = resolve_model(request, req.model, TASK)
        backend = backend_of(request)
        kwargs, renames = model_kwargs_of(req, backend)
        renames["files"] = renames["image"] = "input_reference"
        session = req.session()
    except Exception as exc:
        return exception_response(exc)
    spec = video_spec(backend, new_id("video"), req.prompt, [("input_reference", image)] if image else [], kwargs,
                      session)
    check = getattr(backend, "check_video", None)
    try:  # the model's own refusals are a 400 now, not a failed job later
        if check is not None:
            await anyio.to_thread.run_sync(check, spec)
    except RequestError as exc:
        return exception_response(RequestError(renames.get(exc.field, exc.field), exc.message, exc.status))
    job = Job(id=spec.request_id, created_at=int(time.time()), model=model, prompt=req.prompt,
              size=req.size or f"{kwargs.get('width', 1280)}x{kwargs.get('height', 704)}",
              seconds=f"{kwargs.get('num_frames', 81) / kwargs['fps']:g}")
    jobs = _jobs(request)
    try:
        jobs.admit(job)
    except Exception as exc:
        return exception_response(exc)
    job.task = asyncio.create_task(_run(backend, jobs, job, spec, renames))
    return JSONResponse(job.body())


async def _run(backend: Any, jobs: VideoJobs, job: Job, spec: GenerateSpec, renames: dict[str, str]) -> None:
    job.status = "in_progress"  # handed to the backend (which may still queue it)
    try:
        video = await run_video(backend, spec, renames, on_progress=functools.partial(_progressed, job))
        job.mp4 = await anyio.to_thread.run_sync(video.mp4, spec.model_kwargs["fps"])
        job.progress = 100
        jobs.finish(job, "completed")
        log.info("video job %s completed (%d frames)", job.id, len(video.frames))
    except asyncio.CancelledError:
        raise
    except RequestError as exc:  # the family refused it: the field is the body's (see run_video)
        job.error = {"code": "invalid_request", "message": f"{exc.field}: {exc.message}"}
        jobs.finish(job, "failed")
    except Exception as exc:
        log.warning("video job %s failed: %s", job.id, exc)
        job.error = {"code": "generation_failed", "message": str(exc) or type(exc).__name__}
        jobs.finish(job, "failed")


def _progressed(job: Job, done: int, total: int) -> None:
    """Denoising step ``done`` of ``total`` ended: the job's percentage (99 at most until the
    mp4 is made: decoding and encoding come after the last step)."""
    job.progress = min(99, 100 * done // max(1, total))


async def retrieve_video(request: Request, video_id: str) -> Response:
    try:
        return JSONResponse(_jobs(request).get(video_id).body())
    except Exception as exc:
        return exception_response(exc)


async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    try:
        if variant != "video":
            raise RequestError("variant", f"only 'video' (the mp4) is available, not {variant!r}")
        job = _jobs(request).get(video_id)
        if job.mp4 is None:
            raise APIError(409 if job.status != "failed" else 400,
                           f"video job {video_id!r} is {job.status}, not completed", "video_id")
    except Exception as exc:
        return exception_response(exc)
    return Response(job.mp4, media_type="video/mp4")


async def list_videos(request: Request, after: str | None = None, limit: int = 20, order: str = "desc") -> Response:
    try:
        if order not in ("asc", "desc"):
            raise RequestError("order", "must be 'asc' or 'desc'")
        if not 1 <= limit <= MAX_LIST:
            raise RequestError("limit", f"must be between 1 and {MAX_LIST}")
        jobs = _jobs(request)
        jobs.expire()
        listed = list(jobs.jobs.values())
        if order == "desc":
            listed.reverse()
        if after is not None:
            ids = [j.id for j in listed]
            if after not in ids:
                raise RequestError("after", f"no video job {after!r}")
            listed = listed[ids.index(after) + 1:]
    except Exception as exc:
        return exception_response(exc)
    page = listed[:limit]
    return JSONResponse({"object": "list", "data": [j.body() for j in page], "has_more": len(listed) > limit,
                         "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None})


async def delete_video(request: Request, video_id: str) -> Response:
    try:
        jobs = _jobs(request)
        job = jobs.get(video_id)
    except Exception as exc:
        return exception_response(exc)
    del jobs.jobs[video_id]
    if job.task is not None and not job.task.done():
        job.task.cancel()  # closes the backend stream: the runtime drops the request
        log.info("video job %s deleted while %s; cancelled", video_id, job.status)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


def video_jobs_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/videos", create_video, methods=["POST"],
                         openapi_extra=form_body_openapi(VideoJobForm, {"input_reference": False}))
    router.add_api_route("/v1/videos", list_videos, methods=["GET"])
    router.add_api_route("/v1/videos/{video_id}", retrieve_video, methods=["GET"])
    router.add_api_route("/v1/videos/{video_id}", delete_video, methods=["DELETE"])
    router.add_api_route("/v1/videos/{video_id}/content", video_content, methods=["GET"])
    return router
