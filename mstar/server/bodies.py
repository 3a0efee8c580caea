"""Request bodies read through a byte cap before any of them is decoded, and media named by
reference fetched (``mstar.media.fetch``), concurrently, before the backend sees the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message

from mstar.contract import RequestError
from mstar.media.fetch import fetch_media
from mstar.server.errors import APIError


async def capped_body(request: Request, *, max_bytes: int, field: str = "body") -> bytes:
    """The request body, refused with a 413 naming ``field`` as soon as it is declared or
    streamed past ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(field, f"the request is {declared} bytes; the limit is {max_bytes} bytes", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(field, f"the request is over the limit of {max_bytes} bytes", 413)
    return bytes(body)


async def json_object(request: Request, *, max_bytes: int) -> dict:
    """The request's JSON body, read through ``capped_body``: one that is not JSON, or not
    an object, is a 400 naming ``body``."""
    raw = await capped_body(request, max_bytes=max_bytes)
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", "body", "invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object", "body", "invalid_value")
    return payload


M = TypeVar("M", bound=BaseModel)


async def json_body(request: Request, model: type[M], *, max_bytes: int) -> M:
    """The request's JSON object (``json_object``) validated as ``model``; a field that does
    not validate is a 400 naming it, as FastAPI's own body validation answers."""
    payload = await json_object(request, max_bytes=max_bytes)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def fetch_all(refs: Sequence[tuple[str, str, int]]) -> list[bytes]:
    """Each ``(ref, field, max_bytes)`` resolved by ``fetch_media``, all at once, in order.
    The first refusal is raised and the fetches still running are cancelled."""
    tasks = [asyncio.ensure_future(fetch_media(ref, max_bytes=cap, field=name)) for ref, name, cap in refs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op for those that finished


@asynccontextmanager
async def capped_form(request: Request, *, max_bytes: int, field: str, max_files: int,
                      text_field: str | None = None) -> AsyncIterator[FormData]:
    """The request's form (multipart or urlencoded), read through a byte counter: a body
    declared or streamed past ``max_bytes`` is a 413 naming ``field`` before any part of it
    is decoded; a malformed body is a 400 naming ``field``, a text part over Starlette's 1 MiB
    a 400 naming ``text_field`` (the form's big text field) where given. Uploads are closed
    afterwards."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(field, f"the request is {declared} bytes; the limit is {max_bytes} bytes", 413)
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise RequestError(field, f"the request is over the limit of {max_bytes} bytes", 413)
        return message

    try:
        form = await Request(request.scope, receive).form(max_files=max_files)
    except StarletteHTTPException as exc:  # a malformed multipart body, or a text part over 1 MiB
        big = text_field is not None and str(exc.detail).startswith("Part exceeded maximum size")
        raise RequestError(text_field if big else field, str(exc.detail), exc.status_code) from None
    try:
        yield form
    finally:
        await form.close()
