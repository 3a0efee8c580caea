"""OpenAI's image routes, /v1/images/generations and /v1/images/edits, and image output
from /generate.

Generations take OpenAI's JSON body; edits take its multipart form with 1 to 4 reference
images: uploaded (``image``, or ``image[]`` as the official client sends a list) or named
by reference in repeatable ``image_url`` fields (a data URI or base64; an http(s) URL only
with MSTAR_ALLOW_REMOTE=1), in form order. Both accept the
M* extras ``seed``, ``num_inference_steps`` and ``guidance_scale``, and OpenAI's
``output_format`` (png, the default; jpeg; webp) with ``output_compression`` (0-100, jpeg and
webp only; default 100), check everything
before the backend runs (what this server cannot honour, e.g. ``response_format="url"``,
is a 400 naming the field, never silently ignored), hand an ``ImageSpec`` to the
backend's ``generate_images`` and answer OpenAI's ``{"created", "data": [{"b64_json"}]}``.
The edit form is read through a byte cap (``capped_form``) and each image is size-capped
before it is read whole, then fully decoded (safely, see ``mstar.media.images``) before the
backend sees it. Both bodies are published in /openapi.json (``ImageRequest``,
``ImageEditForm``). If the client disconnects, the backend call is cancelled.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import FormData, UploadFile

from mstar.contract import GenerateSpec, ImageSpec
from mstar.media.images import (
    OUTPUT_FORMATS,
    ImageError,
    check_side,
    decode_image,
    fit_size,
    parse_size,
)
from mstar.server.backend import ImagingBackend
from mstar.server.bodies import capped_form, fetch_all
from mstar.server.errors import (
    APIError,
    BackendFailure,
    error_response,
    exception_response,
    validation_error_response,
)
from mstar.server.schemas import (
    Usage,
    form_body_openapi,
    json_body_openapi,
    new_id,
    now,
)
from mstar.server.served import resolve_model
from mstar.server.streaming import stream_response, unless_disconnected

MAX_UPLOAD_BYTES = 20 * 1024 * 1024  # per reference image
MAX_IMAGE_PIXELS = 6144 * 6144  # per reference image, checked before decoding
MAX_IMAGES = 4  # reference images per request
MAX_PROMPT_CHARS = 4000
MAX_N = 4
DEFAULT_SIZE = (1024, 1024)
_FORM_OVERHEAD = 1024 * 1024  # room for the text fields and the multipart framing
_IMAGE_FIELD = re.compile(r"^image(\[\d*\])?$")  # image, image[], image[0] ...
_IMAGE_URL_FIELD = re.compile(r"^image_url(\[\d*\])?$")
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# Fields accepted only with the value(s) OpenAI defaults to (or that change nothing here).
_DEFAULT_ONLY = {
    "quality": ("auto", "standard"),
    "style": ("vivid",),
    "background": ("auto", "opaque"),
}
_FORM_FIELDS = (
    "prompt", "model", "n", "size", "response_format", "seed", "num_inference_steps",
    "guidance_scale", "user", "output_format", "output_compression", *_DEFAULT_ONLY,
)
_GENERATE_KWARGS = ("width", "height", "n", "seed", "num_inference_steps", "guidance_scale")


class ImageKnobs(BaseModel):
    """The M* extras shared by every image request, and OpenAI's output encoding."""

    model_config = ConfigDict(extra="ignore")

    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=100)
    guidance_scale: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    output_format: str | None = Field(None, description=f"one of {', '.join(OUTPUT_FORMATS)} (default png)")
    output_compression: int | None = Field(None, ge=0, le=100,
                                           description="0-100, for jpeg and webp only (default 100)")

    @field_validator("output_format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None and value not in OUTPUT_FORMATS:
            raise ValueError(f"must be one of {', '.join(OUTPUT_FORMATS)}")
        return value

    def encoding(self, prefix: str = "") -> dict[str, Any]:
        """``output_format`` and ``output_compression`` as the backend takes them (in the
        spec's ``model_kwargs``); compression without a lossy format is refused (the field
        named with ``prefix``)."""
        if self.output_compression is not None and self.output_format not in ("jpeg", "webp"):
            raise _bad(f"{prefix}output_compression", "applies to output_format 'jpeg' or 'webp' only")
        return {k: v for k, v in (("output_format", self.output_format),
                                  ("output_compression", self.output_compression)) if v is not None}


class ImageRequest(ImageKnobs):
    """The body of /v1/images/generations, and the text fields of /v1/images/edits."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    size: str | None = None
    response_format: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    user: str | None = None  # accepted and ignored, like OpenAI's abuse-tracking id

    @field_validator("prompt")
    @classmethod
    def _has_text(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must contain text, not only whitespace")
        return value


class ImageEditForm(ImageRequest):
    """The text fields of /v1/images/edits (a multipart form; the files are ``image``)."""

    image_url: list[str] = Field(
        default_factory=list, max_length=MAX_IMAGES,
        description="reference images by reference, repeatable, after or between the uploads in form order: "
                    "a data URI or base64; an http(s) URL only when the server sets MSTAR_ALLOW_REMOTE=1")


class _ImageKwargs(ImageKnobs):
    """The image knobs in /generate's ``model_kwargs`` (the rest go to the backend as is)."""

    width: int | None = None
    height: int | None = None


class _GenerateKwargs(BaseModel):
    """A wrapper, so that validation errors name ``model_kwargs.<knob>``."""

    model_kwargs: _ImageKwargs


# ------------------------------------------------------------------------ checking


def _bad(param: str, message: str, status: int = 400, code: str = "invalid_value") -> APIError:
    return APIError(status, f"{param}: {message}", param, code)


def _image_error(exc: ImageError) -> Response:
    code = "file_too_large" if exc.status == 413 else "invalid_value"
    message = f"{exc.field}: {exc.message}" if exc.field else exc.message
    return error_response(exc.status, message, exc.field, code)


def _check_options(req: ImageRequest) -> None:
    """Refuse what the schema lets through but this server cannot honour."""
    if req.response_format not in (None, "b64_json"):
        reason = "this server does not host files" if req.response_format == "url" else "unknown"
        raise _bad("response_format", f"{req.response_format!r}: {reason}; use 'b64_json'")
    for name, allowed in _DEFAULT_ONLY.items():
        value = getattr(req, name)
        if value is not None and value not in allowed:
            choices = " or ".join(repr(v) for v in allowed)
            raise _bad(name, f"{value!r} is not supported by this model; only {choices}")
    req.encoding()


def _size(raw: str | None) -> tuple[int, int] | None:
    """``raw`` ("WxH") parsed; None when absent or "auto" (the route's default)."""
    if raw is None or raw.strip() in ("", "auto"):
        return None
    return parse_size(raw)


async def _decode_all(images: Sequence[bytes], field: str) -> tuple[int, int]:
    """Decode every reference image in a worker thread (refusing what is unusable, with an
    ``ImageError`` naming ``field``); the first one's size."""
    first: tuple[int, int] | None = None
    for data in images:
        decode = partial(
            decode_image, data, max_bytes=MAX_UPLOAD_BYTES, max_pixels=MAX_IMAGE_PIXELS, field=field
        )
        image = await anyio.to_thread.run_sync(decode)
        first = first or image.size
    assert first is not None
    return first


def _spec(req: ImageKnobs, request_id: str, prompt: str, size: tuple[int, int],
          images: list[bytes], model_kwargs: dict[str, Any] | None = None) -> ImageSpec:
    return ImageSpec(
        request_id=request_id,
        prompt=prompt,
        width=size[0],
        height=size[1],
        n=req.n or 1,
        seed=req.seed,
        num_inference_steps=req.num_inference_steps,
        guidance_scale=req.guidance_scale,
        images=images,
        model_kwargs={**(model_kwargs or {}), **req.encoding()},
    )


# ------------------------------------------------------------------------- serving


Render = Callable[[list[bytes]], Response]


async def _serve(
    request: Request, backend: ImagingBackend, spec: ImageSpec, render: Render
) -> Response:
    """Run the backend (cancelled if the client leaves) and ``render`` its PNGs."""

    async def work() -> Response:
        try:
            images = await backend.generate_images(spec)
            if not images:
                raise BackendFailure("the backend returned no images")
        except ImageError as exc:
            return _image_error(exc)
        except Exception as exc:
            return exception_response(exc)
        return render(images)

    return await unless_disconnected(request, work)


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def _openai_render(size: tuple[int, int], output_format: str | None) -> Render:
    def render(images: list[bytes]) -> Response:
        return JSONResponse({
            "created": now(),
            "data": [{"b64_json": _b64(png)} for png in images],
            "output_format": output_format or "png",
            "size": f"{size[0]}x{size[1]}",
        })

    return render


async def _generations(request: Request, backend: ImagingBackend) -> Response:
    try:
        try:
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad("body", f"malformed JSON body: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise _bad("body", "the request body must be a JSON object")
        req = ImageRequest.model_validate(payload)
        resolve_model(request, req.model, "image_generation")
        _check_options(req)
        size = _size(req.size) or DEFAULT_SIZE
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except ImageError as exc:
        return _image_error(exc)
    except Exception as exc:
        return exception_response(exc)
    spec = _spec(req, new_id("img"), req.prompt, size, [])
    return await _serve(request, backend, spec, _openai_render(size, req.output_format))


# --------------------------------------------------------------------------- edits


def _check_form_request(request: Request) -> None:
    if not request.headers.get("content-type", "").startswith(_FORM_TYPES):
        raise _bad("image", "the request must be multipart/form-data with the images in 'image' "
                            "(or a form naming them in 'image_url')")


async def _read_upload(upload: UploadFile | str) -> bytes:
    """An uploaded image's bytes, read at most one byte past the cap."""
    if not isinstance(upload, UploadFile):
        raise _bad("image", "must be a file, not a text field")
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        message = f"{upload.filename or 'an image'} is over the limit of {MAX_UPLOAD_BYTES} bytes"
        raise _bad("image", message, 413, "file_too_large")
    return data


async def _read_images(form: FormData) -> list[bytes]:
    """The reference images in form order: the uploads read first, then the ``image_url``
    fields fetched, all at once, each capped (field ``image_url.<i>``)."""
    items = [(k, v) for k, v in form.multi_items() if _IMAGE_FIELD.match(k) or _IMAGE_URL_FIELD.match(k)]
    if not items:
        raise _bad("image", "at least one image is required (an 'image' file or an 'image_url')",
                   code="missing_file")
    if len(items) > MAX_IMAGES:
        raise _bad("image", f"at most {MAX_IMAGES} images may be sent (files and image_url), got {len(items)}")
    uploads = {n: await _read_upload(v) for n, (k, v) in enumerate(items) if _IMAGE_FIELD.match(k)}
    refs = []
    for i, value in enumerate(v for k, v in items if _IMAGE_URL_FIELD.match(k)):
        if not isinstance(value, str):
            raise _bad(f"image_url.{i}", "must be a text field (a data URI, base64 or URL), not a file")
        refs.append((value, f"image_url.{i}", MAX_UPLOAD_BYTES))
    fetched = iter(await fetch_all(refs))
    return [uploads[n] if n in uploads else next(fetched) for n in range(len(items))]


def _form_fields(form: FormData) -> dict[str, str]:
    """The text fields ``ImageRequest`` knows; empty ones count as absent (but the prompt)."""
    fields: dict[str, str] = {}
    for name in _FORM_FIELDS:
        value = form.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _bad(name, "must be a text field, not a file")
        if value.strip() or name == "prompt":
            fields[name] = value if name == "prompt" else value.strip()
    return fields


async def _edits(request: Request, backend: ImagingBackend) -> Response:
    limit = MAX_IMAGES * MAX_UPLOAD_BYTES + _FORM_OVERHEAD
    try:
        _check_form_request(request)
        async with capped_form(request, max_bytes=limit, field="image", max_files=4 * MAX_IMAGES) as form:
            if form.get("mask") is not None:
                raise _bad("mask", "masks are not supported by this model")
            req = ImageRequest.model_validate(_form_fields(form))
            resolve_model(request, req.model, "image_edit")
            _check_options(req)
            requested = _size(req.size)  # the cheap checks first
            images = await _read_images(form)
        first = await _decode_all(images, "image")
        size = requested or fit_size(*first)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except ImageError as exc:
        return _image_error(exc)
    except Exception as exc:
        return exception_response(exc)
    spec = _spec(req, new_id("imgedit"), req.prompt, size, images)
    return await _serve(request, backend, spec, _openai_render(size, req.output_format))


# ------------------------------------------------------------------------ /generate


async def _generate_spec(spec: GenerateSpec) -> ImageSpec:
    """/generate's request as an ``ImageSpec``: ``text`` is the prompt, ``files`` the
    reference images, image knobs come from ``model_kwargs`` (the rest pass through)."""
    if spec.output_modalities != ["image"]:
        raise _bad("output_modalities", "image output cannot be combined with other modalities")
    if not spec.text.strip():
        raise _bad("text", "the prompt must contain text")
    if len(spec.text) > MAX_PROMPT_CHARS:
        raise _bad("text", f"the prompt is over {MAX_PROMPT_CHARS} characters")
    if len(spec.files) > MAX_IMAGES:
        raise _bad("files", f"at most {MAX_IMAGES} reference images, got {len(spec.files)}")
    knobs = _GenerateKwargs.model_validate({"model_kwargs": spec.model_kwargs}).model_kwargs
    knobs.encoding("model_kwargs.")
    width, height = knobs.width, knobs.height
    for name, value in (("width", width), ("height", height)):
        if value is not None:
            check_side(value, name, field=f"model_kwargs.{name}")
    images = [data for _, data in spec.files]
    default = fit_size(*await _decode_all(images, "files")) if images else DEFAULT_SIZE
    size = (width or default[0], height or default[1])
    rest = {k: v for k, v in spec.model_kwargs.items() if k not in _GENERATE_KWARGS}
    return _spec(knobs, spec.request_id, spec.text, size, images, rest)


def _generate_render(spec: ImageSpec, streaming: bool) -> Render:
    """/generate's JSON result (``data.image``: one base64 PNG, a list when n > 1) or
    NDJSON, one line per image, the last with finish_reason and usage."""
    usage = Usage.of(0, 0).model_dump()

    def render(images: list[bytes]) -> Response:
        encoded = [_b64(png) for png in images]
        if not streaming:
            return JSONResponse({
                "request_id": spec.request_id,
                "text": "",
                "finish_reason": "stop",
                "usage": usage,
                "data": {"image": encoded if spec.n > 1 else encoded[0]},
            })

        async def lines() -> AsyncIterator[str]:
            for i, data in enumerate(encoded):
                last = i == len(encoded) - 1
                line: dict[str, Any] = {
                    "request_id": spec.request_id, "modality": "image", "text": "",
                    "index": i, "data": data, "finish_reason": "stop" if last else None,
                }
                if last:
                    line["usage"] = usage
                yield json.dumps(line) + "\n"

        return stream_response(lines(), "application/x-ndjson")

    return render


async def generate_images(
    request: Request, backend: ImagingBackend, spec: GenerateSpec, streaming: bool
) -> Response:
    """/generate with ``output_modalities=["image"]`` over an imaging backend."""
    try:
        image_spec = await _generate_spec(spec)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except ImageError as exc:
        return _image_error(exc)
    except Exception as exc:
        return exception_response(exc)
    return await _serve(request, backend, image_spec, _generate_render(image_spec, streaming))


# -------------------------------------------------------------------------- router


def image_router(backend: ImagingBackend) -> APIRouter:
    """The image routes over ``backend``; its ``generate_images`` is called only once the
    route has checked that the model serves the task."""
    router = APIRouter()

    async def generations(request: Request) -> Response:
        """Text to image (OpenAI's JSON body); base64 PNGs."""
        return await _generations(request, backend)

    async def edits(request: Request) -> Response:
        """Image(s) and text to image (OpenAI's multipart form); base64 PNGs."""
        return await _edits(request, backend)

    router.add_api_route("/v1/images/generations", generations, methods=["POST"],
                         openapi_extra=json_body_openapi(ImageRequest))
    router.add_api_route("/v1/images/edits", edits, methods=["POST"],
                         openapi_extra=form_body_openapi(ImageEditForm, {"image": True}))
    return router
