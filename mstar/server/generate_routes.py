"""``POST /generate``: the native multimodal route (multipart ``text``, ``files``, ``media``,
``output_modalities``, ``streaming``, ``model_kwargs``); a JSON result or NDJSON events.
A voice to clone comes as ``model_kwargs`` ``ref_audio`` / ``ref_text``, resolved here as
/v1/audio/speech resolves them (``voice_refs``) into ``GenerateSpec.reference``."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.server.bodies import capped_form, fetch_all
from mstar.server.errors import (
    exception_response,
    in_band_error,
    validation_error_response,
)
from mstar.server.image_routes import generate_images
from mstar.server.schemas import (
    GenerateForm,
    new_id,
    parse_model_kwargs,
    parse_output_modalities,
)
from mstar.server.served import backend_of, default_generate_outputs
from mstar.server.streaming import (
    Events,
    Tally,
    collect_events,
    start_events,
    stream_response,
    unless_disconnected,
    walk_events,
)
from mstar.server.voice_refs import resolve_reference

MAX_GENERATE_FILES = 16  # files and media references per /generate request
MAX_GENERATE_FILE_BYTES = 64 * 1024 * 1024  # per input, checked before anything decodes it
_FORM_OVERHEAD = 1024 * 1024  # room for the text fields and the multipart framing
SESSION_FIELDS = ("session_id", "resume_session", "end_session", "session_timeout_s")


async def _generate_inputs(form: FormData) -> list[tuple[str, bytes]]:
    """The uploaded ``files``, each read at most one byte past the cap, then the ``media``
    references resolved, all at once (data URI, base64, or http(s) when allowed)."""
    uploads = form.getlist("files")
    refs = form.getlist("media")
    if len(uploads) + len(refs) > MAX_GENERATE_FILES:
        raise RequestError("files", f"at most {MAX_GENERATE_FILES} inputs (files and media), "
                                    f"got {len(uploads) + len(refs)}")
    inputs: list[tuple[str, bytes]] = []
    for i, upload in enumerate(uploads):
        if not isinstance(upload, UploadFile):
            raise RequestError(f"files.{i}", "must be a file part, not a text field")
        data = await upload.read(MAX_GENERATE_FILE_BYTES + 1)
        if len(data) > MAX_GENERATE_FILE_BYTES:
            raise RequestError(f"files.{i}", f"{upload.filename or 'the file'} is over the limit of "
                                             f"{MAX_GENERATE_FILE_BYTES} bytes", 413)
        inputs.append((upload.filename or f"file{i}", data))
    for i, ref in enumerate(refs):
        if not isinstance(ref, str):
            raise RequestError(f"media.{i}", "must be a text field (a data URI, base64 or URL), not a file")
    fetched = await fetch_all([(ref, f"media.{i}", MAX_GENERATE_FILE_BYTES) for i, ref in enumerate(refs)])
    return inputs + [(f"media{i}", data) for i, data in enumerate(fetched)]


async def _generate_spec(request: Request) -> tuple[GenerateSpec, bool]:
    limit = MAX_GENERATE_FILES * MAX_GENERATE_FILE_BYTES + _FORM_OVERHEAD
    async with capped_form(request, max_bytes=limit, field="files", max_files=MAX_GENERATE_FILES,
                           text_field="model_kwargs") as form:
        fields = {name: form.get(name) for name in ("text", "output_modalities", "streaming", "model_kwargs",
                                                    *SESSION_FIELDS)}
        for name, value in fields.items():
            if value is not None and not isinstance(value, str):
                raise RequestError(name, "must be a text field, not a file")
        req = GenerateForm.model_validate({k: v for k, v in fields.items() if v is not None})
        files = await _generate_inputs(form)
    model_kwargs = parse_model_kwargs(req.model_kwargs)
    backend = backend_of(request)
    reference = await resolve_reference(backend, backend.model_id, model_kwargs.pop("ref_audio", None),
                                        model_kwargs.pop("ref_text", None))
    spec = GenerateSpec(
        request_id=new_id("gen"),
        text=req.text,
        files=files,
        output_modalities=parse_output_modalities(req.output_modalities, default_generate_outputs(backend)),
        model_kwargs=model_kwargs,
        reference=reference,
        stream=bool(req.streaming),
        session=req.session(),
    )
    return spec, req.streaming


async def generate(request: Request) -> Response:
    """Native multimodal endpoint (multipart form); a JSON result or NDJSON events."""
    try:
        spec, streaming = await _generate_spec(request)
    except ValidationError as exc:
        return validation_error_response(exc.errors())
    except Exception as exc:
        return exception_response(exc)
    backend = backend_of(request)
    if "image" in spec.output_modalities and "image_generation" in backend.tasks:
        return await generate_images(request, backend, spec, streaming)  # type: ignore[arg-type]
    try:
        first, events = await start_events(lambda: backend.generate(spec), request)
    except Exception as exc:
        return exception_response(exc)
    rate: int | None = getattr(backend, "sample_rate", None)  # of "audio" data, if any
    if streaming:
        body = _generate_ndjson(spec.request_id, first, events, rate, _action_rows(spec, backend))
        return stream_response(body, "application/x-ndjson")

    async def complete() -> Response:
        try:
            out = await collect_events(first, events)
        except Exception as exc:
            return exception_response(exc)
        result: dict[str, Any] = {
            "request_id": spec.request_id,
            "text": "".join(out.text),
            "finish_reason": out.finish_reason,
            "usage": out.usage().model_dump(),
        }
        if out.data:
            result["data"] = {m: base64.b64encode(b).decode() for m, b in out.data.items()}
            if "audio" in out.data and rate:
                result["sample_rate"] = rate
            if "action" in out.data:
                result.update(_action_fields(out.data["action"], _action_rows(spec, backend)))
            if "latent" in out.data:
                result.update(_latent_fields(out.data["latent"]))
        return JSONResponse(result)

    return await unless_disconnected(request, complete)


def _action_rows(spec: GenerateSpec, backend: Any) -> int:
    """Actions in the request's chunk: its own ``action_chunk_size`` where the model takes one
    (Cosmos3's action modes), else the model's."""
    asked = spec.model_kwargs.get("action_chunk_size")
    return asked if isinstance(asked, int) and asked > 0 else getattr(backend, "action_chunk", 0)


def _action_fields(data: bytes, chunk: int) -> dict[str, Any]:
    """A robot policy's action chunk (float32 little-endian, row-major, ``chunk`` actions) as a
    JSON array beside its shape; ``data.action`` keeps the same floats in base64."""
    values = np.frombuffer(data, dtype="<f4")
    rows = values.reshape(chunk or 1, -1)
    return {"action": rows.tolist(), "action_shape": list(rows.shape), "action_dtype": "float32"}


def _latent_fields(data: bytes) -> dict[str, Any]:
    """A model's latent arrays (an ``.npz`` archive of named float32 arrays, base64 in
    ``data.latent``) described beside it: each array's shape and dtype by name. Latents that
    stream one event per frame (raw float32, joined in the reply) are not an archive: nothing
    to describe."""
    if not data.startswith(b"PK"):  # a zip archive's signature
        return {}
    with np.load(io.BytesIO(data)) as archive:
        arrays = {name: {"shape": list(archive[name].shape), "dtype": str(archive[name].dtype)}
                  for name in archive.files}
    return {"latent_format": "npz", "latent_arrays": arrays}


async def _generate_ndjson(
    request_id: str, first: OutputEvent | None, events: Events, sample_rate: int | None = None,
    action_chunk: int = 0,
) -> AsyncIterator[str]:
    """One JSON line per event; the last line carries finish_reason and usage. Binary
    ``data`` is base64; audio lines carry ``sample_rate`` when the backend has one, action
    lines the chunk as a JSON array with its shape (``_action_fields``). A
    denoising model's progress comes as ``{"modality": "progress", "step": k, "total": n}``."""
    tally = Tally()

    def line(**payload: Any) -> str:
        return json.dumps({"request_id": request_id, **payload}) + "\n"

    try:
        async with aclosing(walk_events(first, events, tally)) as walk:
            async for event in walk:
                if event.progress is not None:  # step k of n of a long loop (denoising)
                    yield line(modality="progress", step=event.progress[0], total=event.progress[1])
                    continue
                payload: dict[str, Any] = {
                    "modality": event.modality,
                    "text": event.text,
                    "finish_reason": event.finish_reason,
                }
                if event.data is not None:
                    payload["data"] = base64.b64encode(event.data).decode()
                    if event.modality == "audio" and sample_rate:
                        payload["sample_rate"] = sample_rate
                    if event.modality == "action":
                        payload.update(_action_fields(event.data, action_chunk))
                    if event.modality == "latent":
                        payload.update(_latent_fields(event.data))
                if event.finish_reason:
                    payload["usage"] = tally.usage().model_dump()
                yield line(**payload)
        if tally.finish_reason is None:  # the backend ended without saying why
            usage = tally.usage().model_dump()
            yield line(modality="text", text="", finish_reason="stop", usage=usage)
    except Exception as exc:
        yield line(**in_band_error(exc))
