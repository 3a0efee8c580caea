"""Make a packing test independent of timing: ``held_until(engine, n)`` gives every step of
the engine back unrun (preempted, so the conductor sends it again next tick) until one
call holds the steps of ``n`` different requests. On a busy machine one request's front
end may otherwise finish well before another's, and their steps never share a forward."""

from __future__ import annotations

import time
from contextlib import contextmanager

from mstar.engine.base import Engine, EngineItem, EngineOutput


@contextmanager
def held_until(engine: Engine, requests: int, timeout_s: float = 120.0):
    run = engine.run
    patched = vars(engine).get("run")  # a test's own wrapper, kept under this one
    deadline = time.monotonic() + timeout_s
    released = False

    def held(items: list[EngineItem]) -> list[EngineOutput]:
        nonlocal released
        if not released and len({item.request_id for item in items}) < requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{requests} requests never reached the engine together")
            time.sleep(0.01)
            return [EngineOutput(preempted=True) for _ in items]
        released = True
        return run(items)

    engine.run = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        if patched is None:
            del engine.run
        else:
            engine.run = patched  # type: ignore[method-assign]
