"""Reliability of a real (in-process) SmolLM2 deployment behind the HTTP app: a request
whose model code raises fails alone, a full wait queue answers 429, a request past its
timeout ends with a 504 (in band once streaming), and /metrics reports the pools.

One deployment for the module (max 8 running, 4 waiting); the app is driven through
httpx's ASGI transport. ``Saboteur`` wraps the engine's ``run``: prompts holding a marker
raise at prefill or later, or block the engine (and with it the in-process conductor loop,
which runs the workers synchronously) until released.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from inprocess import poll_drained
from prometheus_client.parser import text_string_to_metric_families

from mstar.config import parse_config
from mstar.contract import RequestError
from mstar.engine.autoregressive import AutoregressiveEngine
from mstar.runtime.launch import Deployment, start
from mstar.server.app import create_app

MODEL = "smollm2"
PAGES = 256
CONFIG = {
    "model": MODEL,
    "max_seq_len": 512,
    "max_concurrent_requests": 8,
    "max_queue_size": 4,
    "resources": {"kv_cache": {"max_num_pages": PAGES, "page_size": 16}},
}
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "List three fruits.",
    "Who wrote Romeo and Juliet?", "Which ocean is the biggest?", "What is the opposite of hot?",
    "Give me one word that rhymes with cat.",
]
FAIL_AT_PREFILL, FAIL_LATER, BLOCK, REFUSE = "POISONNOW", "POISONLATER", "BLOCKER", "REFUSEME"


class Saboteur:
    """Wraps an engine's ``run``: the batch raises if it holds a request whose prompt names
    FAIL_AT_PREFILL (at its prefill) or FAIL_LATER (at its third decode), and raises a
    ``RequestError`` naming ``messages`` (the client's mistake, found by the engine) at the
    prefill of one naming REFUSE; it waits for ``release`` if it holds one naming BLOCK."""

    def __init__(self, engine: AutoregressiveEngine, decode) -> None:
        self.engine, self.decode = engine, decode
        self.original = engine.run
        self.marked: dict[str, str] = {}  # request id -> marker
        self.blocked, self.release = threading.Event(), threading.Event()
        engine.run = self.run  # the worker calls engine.run(batch): the instance attribute wins

    def run(self, items):
        for item in items:
            if item.op == "prefill":
                prompt = self.decode(item.inputs["prompt_ids"].reshape(-1).tolist())
                for marker in (FAIL_AT_PREFILL, FAIL_LATER, BLOCK, REFUSE):
                    if marker in prompt:
                        self.marked[item.request_id] = marker
            marker = self.marked.get(item.request_id)
            if marker == FAIL_AT_PREFILL or (marker == FAIL_LATER and item.iteration >= 2):
                raise RuntimeError(f"poisoned prompt in {item.request_id}")
            if marker == REFUSE and item.op == "prefill":
                raise RequestError("messages", "this engine refuses the prompt", 422)
            if marker == BLOCK and item.op == "prefill":
                self.blocked.set()
                assert self.release.wait(60), "the test never released the blocked engine"
        return self.original(items)

    def restore(self) -> None:
        del self.engine.run


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = start(parse_config(CONFIG), in_process=True)
    try:
        yield d
    finally:
        d.close()


def _engine(d: Deployment) -> AutoregressiveEngine:
    return d.runtime.workers.workers[0].engines["llm"]


@pytest.fixture(scope="module")
def saboteur(deployment: Deployment) -> Iterator[Saboteur]:
    s = Saboteur(_engine(deployment), deployment.spec.tokenizer.decode)
    try:
        yield s
    finally:
        s.release.set()
        s.restore()


@pytest.fixture(scope="module")
def app(deployment: Deployment):
    return create_app(deployment.backend)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mstar", timeout=120)


def _body(content: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


def _sse(text: str) -> list:
    payloads = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def _content(payloads: list) -> str:
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads
                   if isinstance(p, dict) and p.get("choices"))


def _wait_drained(d: Deployment, timeout: float = 20.0) -> None:
    engine = _engine(d)
    # The /metrics gauges are the pool as of the rank's latest StepResult, which the runtime
    # thread takes in just after the worker has freed the pages: wait for it too.
    poll_drained(d, engine, also=lambda: d.runtime.gauges().get("rank0.llm.kv_pages_used") == 0, timeout=timeout)
    assert engine.pool.num_used_pages == 0, f"KV pages still held by {engine.pool.seq_ids()}"
    assert d.runtime.conductor.idle and d.runtime.tracked == {}
    assert d.runtime.admission.waiting == 0


def _metrics(app) -> dict[tuple[str, tuple], float]:
    async def scrape() -> str:
        async with _client(app) as client:
            return (await client.get("/metrics")).text

    out = {}
    for family in text_string_to_metric_families(asyncio.run(scrape())):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


POOL = (("node", "llm"), ("rank", "0"))


def test_metrics_show_the_pool_before_any_request(app) -> None:
    samples = _metrics(app)
    assert samples[("mstar_kv_pages_total", POOL)] == PAGES
    assert samples[("mstar_kv_pages_used", POOL)] == 0
    assert samples[("mstar_requests_waiting", ())] == 0 and samples[("mstar_requests_running", ())] == 0


def test_model_code_exception_fails_only_its_request(deployment: Deployment, saboteur: Saboteur, app) -> None:
    async def run() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with _client(app) as client:
            jobs = [client.post("/v1/chat/completions", json=_body(q)) for q in QUESTIONS]
            jobs.append(client.post("/v1/chat/completions", json=_body(f"Say {FAIL_AT_PREFILL} twice.")))
            jobs.append(client.post("/v1/chat/completions", json=_body(
                f"Tell a long story about {FAIL_LATER}.", max_tokens=64, ignore_eos=True, stream=True)))
            *good, at_prefill, later = await asyncio.wait_for(asyncio.gather(*jobs), 240)
            return good, at_prefill, later

    good, at_prefill, later = asyncio.run(run())
    for response in good:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 < body["usage"]["completion_tokens"] <= 8 and body["choices"][0]["message"]["content"]
    assert at_prefill.status_code == 500
    assert "poisoned prompt" in at_prefill.json()["error"]["message"]
    assert later.status_code == 200  # it had streamed two tokens: the error comes in band
    payloads = _sse(later.text)
    assert payloads[-1] == "[DONE]" and "poisoned prompt" in payloads[-2]["error"]["message"]
    assert _content(payloads)
    _wait_drained(deployment)
    assert deployment.runtime.healthy


def test_an_engines_request_error_is_the_clients_4xx(deployment: Deployment, saboteur: Saboteur, app) -> None:
    """A ``RequestError`` an engine raises on the worker reaches the client as itself: its
    status and the field it names, as a refusal by the frontend would; the batch's other
    requests finish."""
    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with _client(app) as client:
            jobs = [client.post("/v1/chat/completions", json=_body(q)) for q in QUESTIONS[:3]]
            jobs.append(client.post("/v1/chat/completions", json=_body(f"Say {REFUSE} once.")))
            *good, refused = await asyncio.wait_for(asyncio.gather(*jobs), 240)
            return good, refused

    good, refused = asyncio.run(run())
    assert [r.status_code for r in good] == [200] * 3, [r.text for r in good]
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages" and error["message"] == "messages: this engine refuses the prompt", error
    assert error["type"] == "invalid_request_error"
    _wait_drained(deployment)
    assert deployment.runtime.healthy


def test_full_queue_is_refused_with_429(deployment: Deployment, saboteur: Saboteur, app) -> None:
    d = deployment

    async def run() -> tuple[list[httpx.Response], list[httpx.Response], dict]:
        async with _client(app) as client:
            blocker = asyncio.create_task(client.post("/v1/chat/completions", json=_body(f"{BLOCK} hi", 2)))
            while not saboteur.blocked.is_set():  # the conductor's loop is stuck in the engine
                await asyncio.sleep(0.01)
            # 1 running + 7 free slots + 4 queue places: 11 more are taken, the 12th is not
            queued = [asyncio.create_task(client.post("/v1/chat/completions", json=_body(QUESTIONS[i % 8], 2)))
                      for i in range(11)]
            deadline = time.monotonic() + 30
            while d.runtime.admission.waiting < 11 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert d.runtime.admission.waiting == 11
            refused = [await client.post("/v1/chat/completions", json=_body("One more?", 2, stream=stream))
                       for stream in (False, True)]
            gauges = (await client.get("/metrics")).text
            saboteur.release.set()
            done = await asyncio.wait_for(asyncio.gather(blocker, *queued), 240)
            return done, refused, gauges

    try:
        done, refused, gauges = asyncio.run(run())
    finally:
        saboteur.release.set()
    for response in refused:
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "queue_full" and "retry later" in error["message"]
    assert "mstar_requests_waiting 11.0" in gauges
    assert all(r.status_code == 200 for r in done), [r.text for r in done if r.status_code != 200]
    _wait_drained(d)


def test_request_timeout_is_504(deployment: Deployment, monkeypatch: pytest.MonkeyPatch, app) -> None:
    timeout = 3.0
    monkeypatch.setattr(deployment.backend, "timeout_s", timeout)
    long = _body("Tell me a very long story about a dragon.", max_tokens=400, ignore_eos=True)

    async def run() -> tuple[httpx.Response, httpx.Response, float]:
        async with _client(app) as client:
            started = time.monotonic()
            plain, streamed = await asyncio.wait_for(asyncio.gather(
                client.post("/v1/chat/completions", json=long),
                client.post("/v1/chat/completions", json={**long, "stream": True})), 60)
            return plain, streamed, time.monotonic() - started

    plain, streamed, elapsed = asyncio.run(run())
    assert timeout <= elapsed < timeout + 10
    assert plain.status_code == 504, plain.text
    assert plain.json()["error"]["message"] == "request timed out"
    assert streamed.status_code == 200
    payloads = _sse(streamed.text)
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["message"] == "request timed out"
    assert len(_content(payloads)) > 0
    _wait_drained(deployment)


def test_metrics_after_the_traffic(deployment: Deployment, app) -> None:
    _wait_drained(deployment)
    samples = _metrics(app)
    assert samples[("mstar_kv_pages_used", POOL)] == 0
    assert samples[("mstar_kv_pages_total", POOL)] == PAGES
    assert samples[("mstar_sequences", POOL)] == 0
    assert samples[("mstar_requests_waiting", ())] == 0 and samples[("mstar_requests_running", ())] == 0
    chat = (("route", "/v1/chat/completions"),)

    def requests(status: str) -> float:
        key = ("mstar_http_requests_total", (("method", "POST"), ("route", "/v1/chat/completions"), ("status", status)))
        return samples.get(key, 0)

    assert requests("200") >= 8 + 1 + 12 + 1 and requests("429") == 2
    assert requests("500") == 1 and requests("504") == 1 and requests("422") == 1
    assert samples[("mstar_time_to_first_output_seconds_count", chat)] >= 8 + 12
    assert samples[("mstar_http_request_duration_seconds_count", chat)] == sum(
        requests(s) for s in ("200", "422", "429", "500", "504"))
