"""The browser playground: ``GET /`` is the page, ``GET /playground/<file>`` its script,
style and audio worklet, all shipped in the package (``mstar/server/playground/``) and served
as they are: no build step, nothing fetched from elsewhere.

The page holds no secrets and no model data, so it is served without the API key even when
the server has one; the page asks for the key and sends it with every API call it makes. It
learns what to show from ``/v1/models`` (each card's ``tasks``) like any other client.

Only the files named in ``FILES`` are served, each with its content type fixed here rather
than guessed from the platform's MIME table (a module script served as ``text/plain`` is
refused by browsers, and that table differs between systems). The routes stay out of
/openapi.json: they are not part of the API.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from mstar.server.errors import APIError

_JS = "text/javascript; charset=utf-8"
FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "playground.js": _JS,  # the panels: chat, speech, transcription, images
    "audio.js": _JS,  # microphone capture, resampling, WAV and PCM16 encoding
    "realtime.js": _JS,  # the voice agent over /v1/realtime
    "capture-worklet.js": _JS,  # the AudioWorklet that hands microphone frames to audio.js
}

# Everything the page needs is on this server: scripts and styles from here only, audio and
# images as blob:/data: URLs the page makes itself, API calls (and the realtime socket) back
# to this origin. The page is never framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


def _read_files() -> dict[str, bytes]:
    """The shipped files, read once: a file missing from the package fails at start-up."""
    folder = resources.files("mstar.server") / "playground"
    return {name: (folder / name).read_bytes() for name in FILES}


def playground_router() -> APIRouter:
    """``/`` and ``/playground/<file>``, mounted outside the API key's guard."""
    contents = _read_files()
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
               "Content-Security-Policy": CONTENT_SECURITY_POLICY}

    def serve(name: str) -> Response:
        return Response(contents[name], media_type=FILES[name], headers=headers)

    async def page() -> Response:
        return serve("index.html")

    async def asset(name: str) -> Response:
        if name not in FILES or name == "index.html":
            raise APIError(404, f"the playground has no file {name!r}", None, "not_found")
        return serve(name)

    router = APIRouter(include_in_schema=False)
    router.add_api_route("/", page, methods=["GET"])
    router.add_api_route("/playground/{name}", asset, methods=["GET"])
    return router
