"""Clients of a module's live ``server`` (a ``live_server.Server`` fixture the module
defines): the official ``openai`` client and plain HTTP, one each per module, with the
module's ``REQUEST_TIMEOUT_S`` (default 120 s). A module that serves otherwise defines its own."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest


def _timeout(request: pytest.FixtureRequest) -> float:
    return getattr(request.module, "REQUEST_TIMEOUT_S", 120.0)


@pytest.fixture(scope="module")
def oai(server, request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=_timeout(request), max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(server, request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=_timeout(request)) as client:
        yield client
