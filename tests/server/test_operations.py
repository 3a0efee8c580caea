"""/metrics, /health's failure, 429 backpressure, error statuses, the API key and the
refusal of media by URL or path, over a fake backend (no model): what the HTTP layer does
with what the runtime reports."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from mstar.contract import ChatSpec, OutputEvent, Overloaded
from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend

GAUGES = {"requests_waiting": 2.0, "requests_running": 5.0, "rank0.llm.kv_pages_used": 7.0,
          "rank0.llm.kv_pages_total": 64.0, "rank1.talker.kv_pages_used": 0.0, "rank1.talker.kv_pages_total": 32.0}


class GaugedBackend(FakeBackend):
    """The fake backend plus runtime-like gauges, failure and error statuses. Prompts:
    ``full`` -> Overloaded; ``late`` -> times out before any output (504); ``dies`` ->
    two words, then its worker dies (503)."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: str | None = None

    def gauges(self) -> dict[str, float]:
        return dict(GAUGES)

    async def chat(self, spec: ChatSpec) -> AsyncIterator[OutputEvent]:
        prompt = spec.messages[-1]["content"]
        if prompt == "full":
            raise Overloaded("the queue is full", retry_after_s=3)
        if prompt == "late":
            yield OutputEvent(finish_reason="timeout", error="request timed out", error_status=504)
            return
        if prompt == "dies":
            yield OutputEvent(text="one", completion_tokens=1)
            yield OutputEvent(text=" two", completion_tokens=2)
            yield OutputEvent(finish_reason="error", error="worker rank 0 failed: killed", error_status=503)
            return
        async for event in super().chat(spec):
            yield event


@pytest.fixture()
def backend() -> GaugedBackend:
    return GaugedBackend()


@pytest.fixture()
def client(backend: GaugedBackend) -> TestClient:
    return TestClient(create_app(backend))


def _chat(client: TestClient, prompt: str, **extra) -> object:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                     **extra})


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, keyed by (name, sorted labels); parsing proves the format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_requests_time_them_and_read_the_backend_gauges(client: TestClient) -> None:
    assert _chat(client, "hello there").status_code == 200
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a b c"}], "stream": True}) as response:
        assert response.status_code == 200 and "[DONE]" in response.read().decode()
    assert _chat(client, "hi", temperature=9).status_code == 400
    assert client.get("/v1/models").status_code == 200
    assert client.get("/no/such/route").status_code == 404

    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(response.text)
    chat = "/v1/chat/completions"

    def requests(route: str, method: str, status: str) -> float:
        return samples.get(("mstar_http_requests_total", (("method", method), ("route", route), ("status", status))), 0)

    assert requests(chat, "POST", "200") == 2 and requests(chat, "POST", "400") == 1
    assert requests("/v1/models", "GET", "200") == 1
    assert requests("unmatched", "GET", "404") == 1  # unknown paths share one label
    assert samples[("mstar_http_request_duration_seconds_count", (("route", chat),))] == 3
    assert samples[("mstar_time_to_first_output_seconds_count", (("route", chat),))] == 2  # not the 400
    assert samples[("mstar_time_to_first_output_seconds_bucket", (("le", "+Inf"), ("route", chat)))] == 2
    assert samples[("mstar_requests_waiting", ())] == 2 and samples[("mstar_requests_running", ())] == 5
    assert samples[("mstar_kv_pages_used", (("node", "llm"), ("rank", "0")))] == 7
    assert samples[("mstar_kv_pages_total", (("node", "talker"), ("rank", "1")))] == 32
    assert samples[("mstar_healthy", ())] == 1


def test_full_queue_is_429_with_retry_after(client: TestClient) -> None:
    for stream in (False, True):
        response = _chat(client, "full", stream=stream)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"] == {"message": "the queue is full", "type": "rate_limit_error",
                                            "param": None, "code": "queue_full"}
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "full"}])


def test_error_events_keep_their_status(client: TestClient) -> None:
    # a timeout before any output: a plain 504, streaming or not
    for stream in (False, True):
        response = _chat(client, "late", stream=stream)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["message"] == "request timed out"
        assert response.json()["error"]["type"] == "server_error"
    # a worker dying: 503 for a plain request, an in-band error once a stream started
    response = _chat(client, "dies")
    assert response.status_code == 503 and "worker rank 0" in response.json()["error"]["message"]
    response = _chat(client, "dies", stream=True)
    assert response.status_code == 200
    payloads = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and "worker rank 0 failed" in error["message"]
    content = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-2])
    assert content == "one two"


def test_health_names_the_failure(client: TestClient, backend: GaugedBackend) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    backend.is_healthy = False
    backend.failure = "worker rank 0 failed: worker process mstar-worker-0 (pid 42) was killed by SIGKILL"
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["message"] == f"the backend is not healthy: {backend.failure}"
    assert _samples(client.get("/metrics").text)[("mstar_healthy", ())] == 0


def test_api_key_guards_every_route_but_health() -> None:
    app = create_app(GaugedBackend(), api_key="sekret")  # every route is mounted for every model
    client = TestClient(app)
    # the published schema lists every API route; /metrics is left out of it
    schema = app.openapi()["paths"]
    routes = [(method.upper(), path) for path, ops in schema.items() for method in ops] + [("GET", "/metrics")]
    paths = {path for _, path in routes}
    assert {"/v1/chat/completions", "/generate", "/metrics", "/v1/models", "/v1/audio/speech",
            "/v1/audio/transcriptions", "/health"} <= paths
    for method, path in routes:
        if path == "/health":
            assert client.request(method, path).status_code == 200
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
            response = client.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer sekret"}
    assert client.get("/metrics", headers=auth).status_code == 200
    assert client.get("/v1/models", headers=auth).status_code == 200
    # FastAPI's own schema pages are not API routes: they stay open (no model data there)
    assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1:8000/health",
                                 "file:///etc/passwd", "/etc/passwd"])
def test_no_route_fetches_media_by_url_or_path(client: TestClient, backend: GaugedBackend, url: str) -> None:
    """A text-only model refuses an image part, and every model an unknown part type, before
    anything is fetched or the backend sees the request (tests/server/test_chat_media.py
    covers the models that take media)."""
    seen = len(backend.chat_specs)
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "input_audio", "input_audio": url}):
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages[0].content[0]")
    assert len(backend.chat_specs) == seen
