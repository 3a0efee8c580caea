"""/v1/completions over the fake backend: the body becomes a CompletionSpec, plain and SSE
answers have OpenAI's text_completion shape (the official client reads them), echo comes
first, bad input is a 4xx naming the field, and a client that leaves cancels the request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer, wait_until


def _complete(server: LiveServer, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)


def _sse_payloads(response: httpx.Response) -> list:
    return [data if data == "[DONE]" else json.loads(data)
            for line in response.iter_lines() if line.startswith("data: ") for data in [line[len("data: "):]]]


def _stream(server: LiveServer, **body) -> list:
    body = {"model": MODEL, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return _sse_payloads(response)


def test_plain(server: LiveServer) -> None:
    response = _complete(server, prompt="once upon a time")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "once upon a time", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_max_tokens_defaults_to_16_and_gives_length(server: LiveServer, backend: FakeBackend) -> None:
    words = " ".join(f"w{i}" for i in range(20))
    body = _complete(server, prompt=words).json()
    assert backend.completion_specs[-1].max_tokens == 16
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16
    body = _complete(server, prompt="a b c", max_tokens=2).json()
    assert body["choices"][0]["text"] == "a b" and body["choices"][0]["finish_reason"] == "length"
    _complete(server, prompt="a", max_tokens=None)
    assert backend.completion_specs[-1].max_tokens is None  # null: up to the context length


def test_request_becomes_spec() -> None:
    backend = FakeBackend()
    client = TestClient(create_app(backend))
    body = {"model": MODEL, "prompt": "a b", "temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.2, "seed": 7, "stop": "END", "max_tokens": 5, "ignore_eos": True, "echo": True,
            "user": "u", "n": 1, "best_of": 1, "logprobs": None, "suffix": None, "presence_penalty": 0,
            "add_special_tokens": False, "some_future_field": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    spec = backend.completion_specs[-1]
    sp = spec.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.seed) == (0, 0.5, 5, 0.1, 1.2, 7)
    assert (spec.prompt, spec.stop, spec.max_tokens, spec.ignore_eos, spec.echo, spec.add_special_tokens) == (
        "a b", ["END"], 5, True, True, False)
    assert spec.request_id.startswith("cmpl-")
    # every form of one prompt: a string, token ids, and each inside a list
    for prompt, expected in (("x y", "x y"), (["x y"], "x y"), ([3, 1, 4], [3, 1, 4]), ([[3, 1]], [3, 1])):
        response = client.post("/v1/completions", json={"prompt": prompt})
        assert response.status_code == 200 and response.json()["model"] == MODEL, response.text
        assert backend.completion_specs[-1].prompt == expected
        assert backend.completion_specs[-1].add_special_tokens and not backend.completion_specs[-1].echo


def test_stream_sse(server: LiveServer) -> None:
    payloads = _stream(server, prompt="a b c", stream_options={"include_usage": True})
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "a b c"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert all("usage" not in c for c in chunks[:-1])
    assert all("usage" not in c for c in _stream(server, prompt="a b")[:-1])  # only with include_usage


def test_echo_comes_first(server: LiveServer) -> None:
    body = _complete(server, prompt="p q", echo=True).json()
    assert body["choices"][0]["text"] == "p qp q"  # the prompt, then its completion
    assert body["usage"]["completion_tokens"] == 2
    chunks = [c for c in _stream(server, prompt=[5, 6], echo=True) if isinstance(c, dict)]
    assert [c["choices"][0]["text"] for c in chunks] == ["<5> <6>", "<5>", " <6>", ""]


def test_openai_client(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="hi from openai", temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "hi from openai" and completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 3

    chunks = list(client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "<7> <8>"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", logprobs=2)
    assert info.value.param == "logprobs"


BAD_REQUESTS = [
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [[1], [2]]}, 400, "prompt"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": [1, 2.5]}, 400, "prompt"),
    ({"prompt": [True]}, 400, "prompt"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "logprobs": 1}, 400, "logprobs"),
    ({"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "x", "logit_bias": {"50256": -100}}, 400, "logit_bias"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"prompt": "x", "echo": "maybe"}, 400, "echo"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_field(server: LiveServer, body: dict, status: int, param: str) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=10)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"]


def test_malformed_body(server: LiveServer) -> None:
    for content in (b'{"prompt": ', b'["a list"]'):
        response = httpx.post(f"{server.url}/v1/completions", content=content,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    assert _complete(server, prompt="still alive").status_code == 200


def test_model_without_text_completion_is_refused() -> None:
    backend = FakeBackend()
    backend.tasks = frozenset({"chat"})
    response = TestClient(create_app(backend)).post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "does not serve text_completion" in response.json()["error"]["message"]
    assert backend.completion_specs == []


@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors(server: LiveServer, stream: bool) -> None:
    response = _complete(server, prompt="please reject me", stream=stream)
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages"
    response = _complete(server, prompt="crash now", stream=stream)
    assert response.status_code == 500 and "crashed" in response.json()["error"]["message"]


def test_failure_mid_stream_is_in_band(server: LiveServer) -> None:
    payloads = _stream(server, prompt="a b explode c d")
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and "exploded" in errors[0]["error"]["message"]
    assert payloads[-1] == "[DONE]"
    assert "".join(p["choices"][0]["text"] for p in payloads if isinstance(p, dict) and p.get("choices")) == "a b"


def test_sse_disconnect_cancels_backend(server: LiveServer, backend: FakeBackend) -> None:
    prompt = "forever completion-sse-disconnect"
    body = {"model": MODEL, "prompt": prompt, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as response:
        next(response.iter_lines())
    assert wait_until(lambda: prompt in backend.cancelled)


def test_plain_disconnect_cancels_backend(server: LiveServer, backend: FakeBackend) -> None:
    prompt = "forever completion-plain-disconnect"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt}, timeout=httpx.Timeout(10, read=0.3))
    assert wait_until(lambda: prompt in backend.cancelled)
