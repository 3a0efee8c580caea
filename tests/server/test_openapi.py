"""/openapi.json documents every route: each POST route has a request body schema (the
hand-parsed JSON and multipart routes declare theirs from pydantic models), and a request
built from that schema is accepted."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from fuzz_backend import EveryCapabilityBackend

from mstar.server.app import create_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(EveryCapabilityBackend()))


@pytest.fixture(scope="module")
def spec(client: TestClient) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


EXPECTED = {
    ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/generate"),
    ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations"), ("POST", "/v1/audio/speech"),
    ("GET", "/v1/audio/voices"), ("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"),
    ("POST", "/v1/videos/generations"), ("POST", "/v1/videos"), ("GET", "/v1/videos"),
    ("GET", "/v1/videos/{video_id}"), ("DELETE", "/v1/videos/{video_id}"), ("GET", "/v1/videos/{video_id}/content"),
}


def test_every_route_is_published(client: TestClient, spec: dict) -> None:
    published = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    assert published == EXPECTED
    for method, path in EXPECTED:  # and each one is served (an unknown video job is the route's own 404)
        response = client.request(method, path)
        if "{video_id}" in path and response.status_code == 404:
            assert response.json()["error"]["param"] == "video_id", (method, path)
            continue
        assert response.status_code not in (404, 405), (method, path)


def test_every_post_route_has_a_request_body_schema(spec: dict) -> None:
    missing = []
    for path, ops in spec["paths"].items():
        if "post" not in ops:
            continue
        content = ops["post"].get("requestBody", {}).get("content", {})
        schemas = [media.get("schema", {}) for media in content.values()]
        if not schemas or not all(s.get("properties") for s in schemas):
            missing.append(path)
    assert missing == []


@pytest.mark.parametrize(("path", "media_type", "fields"), [
    ("/v1/chat/completions", "application/json", {"messages", "temperature", "max_tokens", "stream"}),
    ("/v1/completions", "application/json", {"prompt", "temperature", "max_tokens", "stream", "echo", "logprobs"}),
    ("/v1/audio/speech", "application/json", {"input", "voice", "response_format", "speed"}),
    ("/generate", "multipart/form-data", {"text", "files", "media", "output_modalities", "streaming"}),
    ("/v1/audio/transcriptions", "multipart/form-data", {"file", "model", "language", "response_format"}),
    ("/v1/audio/translations", "multipart/form-data", {"file", "model", "prompt", "temperature"}),
    ("/v1/images/generations", "application/json", {"prompt", "size", "n", "seed", "num_inference_steps"}),
    ("/v1/images/edits", "multipart/form-data", {"image", "image_url", "prompt", "size", "n", "seed"}),
])
def test_body_schemas_name_the_fields(spec: dict, path: str, media_type: str, fields: set[str]) -> None:
    schema = spec["paths"][path]["post"]["requestBody"]["content"][media_type]["schema"]
    assert fields <= set(schema["properties"]), schema["properties"].keys()
    if media_type == "multipart/form-data":
        files = {name for name, prop in schema["properties"].items()
                 if prop.get("format") == "binary" or prop.get("items", {}).get("format") == "binary"}
        assert files == {"/generate": {"files"}, "/v1/images/edits": {"image"}}.get(path, {"file"})
    assert "$defs" not in str(schema) and "$ref" not in str(schema)  # self-contained


def test_the_published_rules_are_the_enforced_ones(client: TestClient, spec: dict) -> None:
    """A bound the schema publishes is a 400 naming the field when broken."""
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    temperature = next(s for s in chat["properties"]["temperature"]["anyOf"] if s.get("type") == "number")
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": temperature["maximum"] + 0.5}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    transcription = spec["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    formats = transcription["multipart/form-data"]["schema"]["properties"]["response_format"]["enum"]
    for fmt in formats:
        response = client.post("/v1/audio/transcriptions", data={"response_format": fmt},
                               files={"file": ("a.wav", b"RIFF", "audio/wav")})
        assert response.status_code == 200, (fmt, response.text)
    response = client.post("/v1/audio/transcriptions", data={"response_format": "docx"},
                           files={"file": ("a.wav", b"RIFF", "audio/wav")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_chat_content_parts_are_published(spec: dict) -> None:
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"enable_thinking", "chat_template_kwargs", "repetition_penalty"} <= set(chat["properties"])
    content = chat["properties"]["messages"]["items"]["properties"]["content"]["anyOf"]
    assert {"string", "array"} == {branch["type"] for branch in content}
    part = next(branch["items"] for branch in content if branch["type"] == "array")
    assert part["properties"]["type"]["enum"] == ["text", "image_url", "video_url", "input_audio"]
    assert "url" in part["properties"]["image_url"]["anyOf"][0]["properties"]


def test_the_published_image_rules_are_the_enforced_ones(client: TestClient, spec: dict) -> None:
    generations = spec["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
    n = next(s for s in generations["schema"]["properties"]["n"]["anyOf"] if s.get("type") == "integer")
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "n": n["maximum"]})
    assert response.status_code == 200 and len(response.json()["data"]) == n["maximum"]
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "n": n["maximum"] + 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
