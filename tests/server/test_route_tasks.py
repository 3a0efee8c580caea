"""Every route x every registered model: a route whose task the model does not serve answers
400 naming ``model`` before the model sees the request; one it serves reaches the model; no
route answers a 5xx.

Each model is its real ModelSpec class (nothing loaded) behind the real ``RuntimeBackend``
over a stub runtime. The spec's request methods are replaced by a probe that records the
call and refuses with a 422 naming ``probe``: reaching the model is visible, and cheap.
"""

from __future__ import annotations

import io
import types
import wave
from functools import cache

import pytest
from fastapi.routing import APIWebSocketRoute
from fastapi.testclient import TestClient
from PIL import Image

from mstar.config import parse_config
from mstar.contract import TASKS, RequestError
from mstar.model.composite import ComposedSpec
from mstar.model.registry import model_class, registered
from mstar.runtime.agent import ComposedBackend
from mstar.runtime.backend import RuntimeBackend
from mstar.server.app import create_app

MODEL_METHODS = ("prepare_chat", "prepare_completion", "prepare_generate", "prepare_speech", "prepare_image",
                 "transcribe")


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    return out.getvalue()


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


AUDIO = {"file": ("a.wav", _wav(), "audio/wav")}
# (method, path) -> (the task it needs, None: every model serves it; the request's arguments)
ROUTES = {
    ("POST", "/v1/chat/completions"): ("chat", {"json": {"messages": [{"role": "user", "content": "hi"}]}}),
    ("POST", "/v1/completions"): ("text_completion", {"json": {"prompt": "once upon a time"}}),
    ("POST", "/v1/audio/transcriptions"): ("transcription", {"files": AUDIO}),
    ("POST", "/v1/audio/translations"): ("translation", {"files": AUDIO}),
    ("POST", "/v1/audio/speech"): ("speech", {"json": {"input": "hello there"}}),
    ("GET", "/v1/audio/voices"): ("speech", {}),
    ("POST", "/v1/images/generations"): ("image_generation", {"json": {"prompt": "a kite", "size": "256x256"}}),
    ("POST", "/v1/images/edits"): ("image_edit", {"data": {"prompt": "a kite"},
                                                  "files": {"image": ("a.png", _png(), "image/png")}}),
    ("POST", "/v1/videos/generations"): ("video_generation", {"json": {"prompt": "a kite", "size": "64x64"}}),
    ("POST", "/v1/videos"): ("video_generation", {"data": {"prompt": "a kite"}}),
    ("GET", "/v1/videos"): ("video_generation", {}),
    ("GET", "/v1/videos/{video_id}"): ("video_generation", {}),
    ("DELETE", "/v1/videos/{video_id}"): ("video_generation", {}),
    ("GET", "/v1/videos/{video_id}/content"): ("video_generation", {}),
    ("POST", "/generate"): (None, {"data": {"text": "hello"}}),
    ("GET", "/v1/models"): (None, {}),
    ("GET", "/health"): (None, {}),
    ("GET", "/metrics"): (None, {}),
    ("WS", "/v1/realtime"): ("realtime", {}),  # a WebSocket: test_realtime_route_checks_what_the_model_serves
    ("WS", "/generate/ws"): (None, {}),  # every model, as /generate: tests/e2e/test_sessions_served.py
}


class Probe:
    """Stands in for a spec's request methods: records the call, refuses with a 422."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def method(self, name: str):
        def refuse(*args, **kwargs):
            self.calls.append(name)
            raise RequestError("probe", f"{name} reached the model", 422)

        async def refuse_async(*args, **kwargs):
            refuse()

        return refuse_async if name == "transcribe" else refuse


@cache
def _served(key: str) -> tuple[TestClient, Probe]:
    spec = model_class(key)(parse_config({"model": key}))
    probe = Probe()
    runtime = types.SimpleNamespace(healthy=True, failure=None, gauges=dict)
    if isinstance(spec, ComposedSpec):  # a many-model deployment: the probe stands in for each part's model
        for member in spec.members.values():
            for name in MODEL_METHODS:
                setattr(member, name, probe.method(name))
        return TestClient(create_app(ComposedBackend(spec, runtime))), probe  # type: ignore[arg-type]
    for name in MODEL_METHODS:
        setattr(spec, name, probe.method(name))
    return TestClient(create_app(RuntimeBackend(spec, runtime))), probe  # type: ignore[arg-type]


def test_the_table_lists_every_route() -> None:
    """Every API route (those the schema publishes, and /metrics) is in ``ROUTES``, and
    every task has a route."""
    client, _ = _served("smollm2")
    schema = client.app.openapi()["paths"]  # type: ignore[attr-defined]
    mounted = {(method.upper(), path) for path, ops in schema.items() for method in ops}
    sockets = {("WS", route.path) for route in client.app.routes if isinstance(route, APIWebSocketRoute)}
    assert mounted | sockets | {("GET", "/metrics")} == set(ROUTES)
    assert {task for task, _ in ROUTES.values() if task} == set(TASKS)


@pytest.mark.parametrize("key", [key for key in registered() if model_class(key).__module__.startswith("mstar.")])
@pytest.mark.parametrize(("method", "path"), [route for route in ROUTES if route[0] != "WS"])
def test_route_checks_what_the_model_serves(key: str, method: str, path: str) -> None:
    client, probe = _served(key)
    task, arguments = ROUTES[(method, path)]
    probe.calls.clear()
    if (method, path) == ("POST", "/v1/videos") and getattr(model_class(key), "video_needs_image", False):
        arguments = {**arguments, "files": {"input_reference": ("start.png", _png(), "image/png")}}
    response = client.request(method, path, **arguments)
    assert response.status_code < 500, response.text
    speaks_in_chat = path == "/v1/audio/voices" and "audio" in model_class(key).output_modalities
    if task is not None and task not in model_class(key).tasks and not speaks_in_chat:
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "model"), error
        assert f"{key!r} does not serve {task}" in error["message"]
        assert probe.calls == []  # refused before the model saw it
    elif path == "/v1/videos" and method == "POST":  # a job: queued now, the model sees it in the background
        assert response.status_code == 200 and response.json()["object"] == "video", response.text
    elif "{video_id}" in path:  # no such job
        assert (response.status_code, response.json()["error"]["param"]) == (404, "video_id"), response.text
    elif method == "POST":
        assert (response.status_code, response.json()["error"]["param"]) == (422, "probe"), response.text
        assert len(probe.calls) >= 1
    else:
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("key", [key for key in registered() if model_class(key).__module__.startswith("mstar.")
                                 and "realtime" not in model_class(key).tasks])
def test_realtime_route_checks_what_the_model_serves(key: str) -> None:
    """A model without the ``realtime`` task is refused on /v1/realtime: an ``error`` event
    naming ``model``, then a close (the route's own tests cover a model that serves it)."""
    client, probe = _served(key)
    probe.calls.clear()
    with client.websocket_connect("/v1/realtime") as socket:
        error = socket.receive_json()["error"]
        assert error["param"] == "model" and f"{key!r} does not serve realtime" in error["message"]
        assert socket.receive()["type"] == "websocket.close"
    assert probe.calls == []
