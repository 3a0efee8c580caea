"""Helpers for tests that drive an in-process deployment: start one and close it after,
record the batches an engine runs, and wait until every request's resources are released
(releases ride on the conductor's next plan after a request ends)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@contextmanager
def deployed(config: dict) -> Iterator:
    """An in-process deployment of ``config`` (the YAML's keys as a dict), closed on exit."""
    from mstar.config import parse_config
    from mstar.runtime.launch import start

    d = start(parse_config(config), in_process=True)
    try:
        yield d
    finally:
        d.close()


@dataclass
class Recorder:
    """Every batch the engine ran, as (request_id, op) pairs."""

    batches: list[list[tuple[str, str]]] = field(default_factory=list)

    def since(self, mark: int) -> list[list[tuple[str, str]]]:
        return self.batches[mark:]


@contextmanager
def record_batches(engine) -> Iterator[Recorder]:
    original = engine.run
    rec = Recorder()

    def recording_run(items):
        rec.batches.append([(item.request_id, item.op) for item in items])
        return original(items)

    engine.run = recording_run  # the worker calls engine.run(batch): the instance attribute wins
    try:
        yield rec
    finally:
        del engine.run


def poll_drained(deployment, engine, also: Callable[[], bool] = lambda: True, timeout: float = 10.0) -> None:
    """Wait until the engine holds no pages, the conductor is idle and nothing is tracked
    (and ``also()`` holds); the caller asserts what it needs afterwards."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (engine.pool.num_used_pages == 0 and deployment.runtime.conductor.idle
                and not deployment.runtime.tracked and also()):
            return
        time.sleep(0.02)
