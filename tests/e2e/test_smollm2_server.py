"""End to end: the real ``mstar serve smollm2`` CLI in a subprocess, exercised over HTTP.

One server per module (multi-process mode: a worker process, ZeroMQ, SHM transport),
started from a scratch directory with its output in a log file; it is stopped (SIGTERM,
then SIGKILL to its whole process group) however the tests end. Requests go through raw
httpx, the official ``openai`` client and the M* SDK.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import Server, launch_server

from mstar.client import MStarClient

MODEL = "smollm2"
QUESTION = "Name the capital of France."
STARTUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0


def _group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the processes of a process group (Linux)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _wait_until_idle(server: Server, timeout: float = 20.0) -> None:
    """Wait until the server's processes stop computing: a cancelled request no longer
    decodes. Fails if they keep using CPU (a request that outlived its client)."""
    if not Path("/proc/self/stat").exists():  # pragma: no cover - not Linux
        return
    deadline = time.monotonic() + timeout
    used = 0.0
    while time.monotonic() < deadline:
        before = _group_cpu_seconds(server.proc.pid)
        time.sleep(1.0)
        used = _group_cpu_seconds(server.proc.pid) - before
        if used < 0.15:
            return
    pytest.fail(f"the server still used {used:.2f} CPU s per second {timeout:.0f} s after its client left")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(MODEL, tmp_path_factory.mktemp("smollm2-server"),
                       startup_timeout=STARTUP_TIMEOUT_S) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server: Server) -> Iterator[MStarClient]:
    with MStarClient(server.url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def _body(content: str = QUESTION, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 32, **extra}


def _sse(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response, parsed (``[DONE]`` kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _ask_paris(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_body())
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------- basics


def test_health_and_models(http: httpx.Client, server: Server) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert MODEL in [m["id"] for m in models["data"]]
    card = next(m for m in models["data"] if m["id"] == MODEL)
    assert card["object"] == "model" and card["max_model_len"] > 0
    assert f"serving {MODEL} on {server.url}" in server.log_tail(200_000)


# ------------------------------------------------------------- raw HTTP (curl)


def test_raw_chat_plain(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_raw_chat_streaming(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = _sse(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks and all(isinstance(c, dict) and c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_raw_chat_streaming_matches_plain(http: httpx.Client) -> None:
    plain = http.post("/v1/chat/completions", json=_body()).json()["choices"][0]["message"]["content"]
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as response:
        chunks = [c for c in _sse(response) if isinstance(c, dict)]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == plain


# ------------------------------------------------------------- official client


def test_openai_client_plain(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32)
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens > 0


def test_openai_client_streaming_with_usage(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].usage.prompt_tokens > 0


def test_openai_client_error_is_typed(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                    temperature=3)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


# -------------------------------------------------------------------- /generate


def _generate_form(**extra: str) -> dict:
    # (None, value) parts: a multipart/form-data body with plain (non-file) fields
    fields = {"text": QUESTION, "model_kwargs": json.dumps({"temperature": 0, "max_tokens": 32}), **extra}
    return {name: (None, value) for name, value in fields.items()}


def test_generate_plain(http: httpx.Client) -> None:
    response = http.post("/generate", files=_generate_form())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"].startswith("gen-")
    assert "Paris" in body["text"]
    assert body["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] > 0
    assert "data" not in body


def test_generate_ndjson_streaming(http: httpx.Client) -> None:
    with http.stream("POST", "/generate", files=_generate_form(streaming="true")) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line.strip()]
    assert len(lines) > 1
    assert len({line["request_id"] for line in lines}) == 1
    assert "Paris" in "".join(line["text"] for line in lines)
    assert lines[-1]["finish_reason"] == "stop" and lines[-1]["usage"]["completion_tokens"] > 0
    assert all(line["finish_reason"] is None for line in lines[:-1])


def test_generate_rejects_files(http: httpx.Client) -> None:
    form = _generate_form()
    response = http.post("/generate", data={k: v[1] for k, v in form.items()},
                         files=[("files", ("a.png", b"\x89PNG", "image/png"))])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "files"


# -------------------------------------------------------------------------- SDK


def test_sdk_chat(sdk: MStarClient) -> None:
    assert sdk.health()
    assert MODEL in sdk.models()
    result = sdk.chat(QUESTION, temperature=0)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


def test_sdk_chat_streaming(sdk: MStarClient) -> None:
    events = list(sdk.chat(QUESTION, temperature=0, stream=True))
    assert "Paris" in "".join(e.text for e in events)
    assert [e.finish_reason for e in events if e.finish_reason] == ["stop"]
    assert events[-1].usage and events[-1].usage["completion_tokens"] > 0


# ------------------------------------------------------------ request options


def test_stop_string(sdk: MStarClient) -> None:
    result = sdk.chat(QUESTION, temperature=0, stop=["Paris"])
    assert "Paris" not in result.text
    assert result.text.startswith("The capital of France")
    assert result.finish_reason == "stop"


def test_stop_string_streaming(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True, stop=["Paris"])) as response:
        chunks = [c for c in _sse(response) if isinstance(c, dict)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" not in text and text.startswith("The capital of France")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_gives_length(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json=_body(max_tokens=3)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["content"].strip()


def test_seeded_sampling_is_reproducible(sdk: MStarClient) -> None:
    texts = [sdk.chat("Write a short poem about the sea.", temperature=0.8, seed=7, max_tokens=24).text
             for _ in range(2)]
    assert texts[0] and texts[0] == texts[1]


# ----------------------------------------------------------------- bad requests


BAD_REQUESTS = {
    "malformed_json": (b'{"model": "smollm2", "messages": [', 400, "body"),
    "unknown_model": (_body(model="no-such-model"), 404, "model"),
    "empty_messages": ({"model": MODEL, "messages": []}, 400, "messages"),
    "negative_max_tokens": (_body(max_tokens=-5), 400, "max_tokens"),
    "temperature_too_high": (_body(temperature=3), 400, "temperature"),
    "max_tokens_over_context": (_body(max_tokens=100000), 400, "max_tokens"),
    # passes the max_model_len check, but the prompt's tokens + max_tokens do not fit
    "prompt_plus_max_tokens_over_context": (None, 400, "max_tokens"),
}


def _max_model_len(http: httpx.Client) -> int:
    return next(m["max_model_len"] for m in http.get("/v1/models").json()["data"] if m["id"] == MODEL)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(http: httpx.Client, case: str) -> None:
    payload, status, param = BAD_REQUESTS[case]
    if payload is None:
        payload = _body(max_tokens=_max_model_len(http) - 2)
    if isinstance(payload, bytes):
        response = http.post("/v1/chat/completions", content=payload,
                             headers={"content-type": "application/json"})
    else:
        response = http.post("/v1/chat/completions", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"]


def test_streaming_bad_request_is_plain_error(http: httpx.Client) -> None:
    too_many = _max_model_len(http) - 2
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True, max_tokens=too_many)) as response:
        response.read()
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_server_still_answers_after_bad_requests(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    _ask_paris(http)


# -------------------------------------------------------------------- disconnects


def test_streaming_client_disconnect(http: httpx.Client, server: Server) -> None:
    long = _body("Tell me a very long story about a dragon.", stream=True, max_tokens=1500, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        with client.stream("POST", "/v1/chat/completions", json=long) as response:
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data:"))
            assert json.loads(first[len("data:"):])["object"] == "chat.completion.chunk"
    # the connection is gone: the request is cancelled and the server carries on as before
    _wait_until_idle(server)
    assert http.get("/health").status_code == 200
    _ask_paris(http)
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as response:
        payloads = _sse(response)
    assert payloads[-1] == "[DONE]"
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content") or ""
                              for c in payloads if isinstance(c, dict) and c["choices"])
    assert server.proc.poll() is None


def test_plain_client_disconnect(server: Server, http: httpx.Client) -> None:
    long = _body("Tell me a very long story about a dragon.", max_tokens=1500, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=long)
    _wait_until_idle(server)
    _ask_paris(http)
    assert server.proc.poll() is None
