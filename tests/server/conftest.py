"""Shared fixtures for the HTTP tests: a fake backend and a live uvicorn server (both in
tests/support/fake_backend.py, which the tests import by that path: importing them from
``conftest`` took whichever conftest Python had met first)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:  # the repository root is not on sys.path when pytest is run as a script
    import mstar  # noqa: F401
except ModuleNotFoundError:  # pragma: no cover - depends on how pytest is invoked
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mstar.server.app import create_app
from tests.support.fake_backend import MODEL, FakeBackend, LiveServer


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def server(backend: FakeBackend) -> Iterator[LiveServer]:
    with LiveServer(create_app(backend, served_model_names=[MODEL, "alias"])) as live:
        yield live
