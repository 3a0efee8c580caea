"""HTTP API tests over a fake backend: OpenAI chat (plain, SSE, official client),
/v1/models, /health, /generate (JSON, NDJSON), errors, auth and cancellation."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, wait_until


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _chat(server: LiveServer, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)


def _sse_payloads(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response, parsed (``[DONE]`` kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ------------------------------------------------------------------------ basics


def test_models_and_health(server: LiveServer) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"]
    assert all(m["object"] == "model" for m in models["data"])
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_unhealthy_backend_is_503() -> None:
    backend = FakeBackend()
    backend.is_healthy = False
    response = TestClient(create_app(backend)).get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


def test_unknown_route_has_openai_error_body(server: LiveServer) -> None:
    response = httpx.get(f"{server.url}/v1/nope")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# -------------------------------------------------------------------------- chat


def test_chat_plain(server: LiveServer) -> None:
    response = _chat(server, messages=_user("hello there world"))
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello there world"}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_max_tokens_gives_length(server: LiveServer) -> None:
    body = _chat(server, model="alias", messages=_user("one two three four"), max_tokens=2).json()
    assert body["model"] == "alias"
    assert body["choices"][0]["message"]["content"] == "one two"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_chat_request_becomes_spec() -> None:
    backend = FakeBackend()
    client = TestClient(create_app(backend))
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]},
        ],
        "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2,
        "seed": 7, "stop": "END", "max_completion_tokens": 5, "ignore_eos": True, "user": "u",
        "presence_penalty": 0, "some_future_field": {"x": 1},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    spec = backend.chat_specs[-1]
    assert spec.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b\nc"}]
    sp = spec.sampling
    got = (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.seed)
    assert got == (0, 0.5, 0, 0.1, 1.2, 7)
    assert sp.greedy and spec.stop == ["END"] and spec.max_tokens == 5 and spec.ignore_eos
    assert spec.request_id.startswith("chatcmpl-")
    # the model may be left out: the served one is used
    assert client.post("/v1/chat/completions", json={"messages": _user("x")}).json()["model"] == MODEL


def test_chat_stream_sse(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": _user("a b c"), "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "a b c"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6


def test_openai_client(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    completion = client.chat.completions.create(model=MODEL, messages=_user("hi from openai"), temperature=0)
    assert completion.choices[0].message.content == "hi from openai"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 3

    stream = client.chat.completions.create(model=MODEL, messages=_user("x y z"), max_tokens=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x y"
    assert chunks[-1].choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL, messages=_user("p q"), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "p q"

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]


# ------------------------------------------------------------------------ errors


BAD_REQUESTS = [
    ({"messages": _user("x"), "model": "nope"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": _user("x"), "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": _user("x"), "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": _user("x"), "temperature": 3}, 400, "temperature"),
    ({"messages": _user("x"), "top_p": 0}, 400, "top_p"),
    ({"messages": _user("x"), "top_k": -2}, 400, "top_k"),
    ({"messages": _user("x"), "n": 2}, 400, "n"),
    ({"messages": _user("x"), "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": _user("x"), "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": _user("x"), "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user"}], "stream": "maybe"}, 400, "stream"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_bad_request_names_the_field(server: LiveServer, body: dict, status: int, param: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param
    assert param.split(".")[0] in error["message"] and error["type"]
    assert _chat(server, messages=_user("still alive")).status_code == 200


def test_malformed_json(server: LiveServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "body"
    assert "JSON" in response.json()["error"]["message"]
    assert _chat(server, messages=_user("still alive")).status_code == 200


def test_openai_client_sees_param(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_user("x"), temperature=3)
    assert info.value.param == "temperature"


@pytest.mark.parametrize("stream", [False, True])
def test_backend_request_error_is_its_status(server: LiveServer, stream: bool) -> None:
    response = _chat(server, messages=_user("please reject me"), stream=stream)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "messages" and "rejects" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_backend_crash_is_500(server: LiveServer, stream: bool) -> None:
    response = _chat(server, messages=_user("crash now"), stream=stream)
    assert response.status_code == 500
    assert "crashed" in response.json()["error"]["message"]
    assert _chat(server, messages=_user("still alive")).status_code == 200


def test_failure_mid_stream_is_in_band(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": _user("a b explode c d"), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        payloads = _sse_payloads(response)  # returns: the server ended the stream
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and "exploded" in errors[0]["error"]["message"]
    assert payloads[-1] == "[DONE]"
    chunks = [p for p in payloads if isinstance(p, dict) and p.get("choices")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "a b"

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model=MODEL, messages=_user("a b explode c"), stream=True))


# ------------------------------------------------------------------ cancellation


def test_sse_disconnect_cancels_backend(server: LiveServer, backend: FakeBackend) -> None:
    prompt = "forever sse-disconnect"
    body = {"model": MODEL, "messages": _user(prompt), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as response:
        next(response.iter_lines())
    assert wait_until(lambda: prompt in backend.cancelled)


def test_ndjson_disconnect_cancels_backend(server: LiveServer, backend: FakeBackend) -> None:
    prompt = "forever ndjson-disconnect"
    form = {"text": prompt, "streaming": "true"}
    with httpx.stream("POST", f"{server.url}/generate", data=form, timeout=10) as response:
        assert json.loads(next(response.iter_lines()))["text"] == " forever"
    assert wait_until(lambda: prompt in backend.cancelled)


def test_non_streaming_disconnect_cancels_backend(server: LiveServer, backend: FakeBackend) -> None:
    prompt = "forever plain-disconnect"
    with pytest.raises(httpx.ReadTimeout):
        _chat_timeout = httpx.Timeout(10, read=0.3)
        httpx.post(f"{server.url}/v1/chat/completions", json={"messages": _user(prompt)}, timeout=_chat_timeout)
    assert wait_until(lambda: prompt in backend.cancelled)


# ---------------------------------------------------------------------- generate


def test_generate_plain_with_file(server: LiveServer, backend: FakeBackend) -> None:
    response = httpx.post(
        f"{server.url}/generate",
        data={"text": "describe this", "output_modalities": "text,audio", "model_kwargs": '{"voice": "x"}'},
        files=[("files", ("a.png", b"12345", "image/png"))],
        timeout=10,
    )
    assert response.status_code == 200
    body = response.json()
    assert body["text"] == "describe this [a.png:5]" and body["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 3
    assert base64.b64decode(body["data"]["audio"]) == b"RIFF-fake-audio"
    spec = backend.generate_specs[-1]
    assert spec.request_id == body["request_id"]
    assert spec.files == [("a.png", b"12345")] and spec.output_modalities == ["text", "audio"]
    assert spec.model_kwargs == {"voice": "x"}


def test_generate_streaming_ndjson(server: LiveServer) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        data={"text": "one two three", "streaming": "true", "output_modalities": '["text", "audio"]'},
        files=[("files", ("clip.wav", b"abc", "audio/wav"))],
        timeout=10,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["text"] for line in lines if line["modality"] == "text") == "one two three [clip.wav:3]"
    audio = [line for line in lines if line["modality"] == "audio"]
    assert base64.b64decode(audio[0]["data"]) == b"RIFF-fake-audio"
    assert lines[-1]["finish_reason"] == "stop" and lines[-1]["usage"]["completion_tokens"] == 4
    assert all(line["finish_reason"] is None for line in lines[:-1])
    assert len({line["request_id"] for line in lines}) == 1


def test_generate_defaults_and_no_files() -> None:
    backend = FakeBackend()
    body = TestClient(create_app(backend)).post("/generate", data={"text": "hi"}).json()
    assert body["text"] == "hi" and "data" not in body
    spec = backend.generate_specs[-1]
    assert spec.output_modalities == ["text"] and spec.model_kwargs == {} and spec.files == []


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"model_kwargs": "{not json"}, "model_kwargs"),
        ({"model_kwargs": "[1, 2]"}, "model_kwargs"),
        ({"output_modalities": '["text", 3]'}, "output_modalities"),
        ({"output_modalities": " , "}, "output_modalities"),
        ({"streaming": "maybe"}, "streaming"),
    ],
)
def test_generate_bad_form(server: LiveServer, form: dict, param: str) -> None:
    response = httpx.post(f"{server.url}/generate", data={"text": "x", **form}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_generate_mid_stream_failure_is_in_band(server: LiveServer) -> None:
    form = {"text": "a b explode c", "streaming": "true"}
    with httpx.stream("POST", f"{server.url}/generate", data=form, timeout=10) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "exploded" in lines[-1]["error"]["message"]


# -------------------------------------------------------------------------- auth


def test_api_key() -> None:
    client = TestClient(create_app(FakeBackend(), api_key="sekret"))
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    denied = client.post("/v1/chat/completions", json={"messages": _user("x")})
    assert denied.status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    ok = client.post("/v1/chat/completions", json={"messages": _user("x")}, headers=auth)
    assert ok.status_code == 200
