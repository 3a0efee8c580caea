"""The playground over plain HTTP: ``/`` is the page, without the API key even when the server
has one; every file the page and its modules load is served with its content type; nothing
else is; and /v1/models says what the model serves (the page shows a panel per task).
The page in a real browser: tests/e2e/test_playground_browser.py."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from mstar.server.app import create_app
from mstar.server.playground_routes import FILES
from tests.support.fake_backend import FakeBackend

KEY = "sekret"


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(FakeBackend(), api_key=KEY))


def _referenced(text: str) -> set[str]:
    """The playground files a page or module names: src/href attributes, ES module imports
    and URLs built from ``import.meta.url``."""
    names = re.findall(r'(?:src|href)="playground/([\w.-]+)"', text)
    names += re.findall(r'from "\./([\w.-]+)"', text)
    names += re.findall(r'new URL\("([\w.-]+)", import\.meta\.url\)', text)
    return set(names)


def test_the_page_is_served_without_the_key(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>M* playground</title>" in page.text
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in page.headers["content-security-policy"]  # nothing from elsewhere
    assert client.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_every_file_the_page_loads_is_served_with_its_type(client: TestClient) -> None:
    seen: set[str] = set()
    todo = _referenced(client.get("/").text)
    assert {"playground.js", "playground.css"} <= todo
    while todo:
        name = todo.pop()
        seen.add(name)
        response = client.get(f"/playground/{name}")
        assert response.status_code == 200, name
        expected = {"js": "text/javascript", "css": "text/css"}[name.rsplit(".", 1)[1]]
        assert response.headers["content-type"] == f"{expected}; charset=utf-8", name
        todo |= _referenced(response.text) - seen
    assert seen == set(FILES) - {"index.html"}  # every shipped file is used, none is missing
    assert not re.search(r"https?://", "".join(client.get(f"/playground/{n}").text for n in seen))


@pytest.mark.parametrize("path", ["/playground/nope.js", "/playground/index.html", "/playground/..%2Fapp.py",
                                  "/playground/"])
def test_nothing_else_is_served(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "error" in response.json()


class FakeAgent(FakeBackend):
    """A many-model deployment: it serves everything its parts do, each part its own."""

    model_id = "agent"
    tasks = frozenset({"realtime", "speech", "chat", "transcription"})
    model_aliases = {"talker": frozenset({"chat"}), "voice": frozenset({"speech"})}


def test_models_list_their_tasks(client: TestClient) -> None:
    cards = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert cards[0]["tasks"] == ["chat", "text_completion"]  # in mstar.contract.TASKS's order
    cards = TestClient(create_app(FakeAgent())).get("/v1/models").json()["data"]
    assert {card["id"]: card["tasks"] for card in cards} == {
        "agent": ["chat", "transcription", "speech", "realtime"], "talker": ["chat"], "voice": ["speech"]}


def test_the_playground_stays_out_of_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/playground") for p in paths)
