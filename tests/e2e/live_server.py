"""Shared helpers for the end-to-end tests: a real ``mstar serve`` CLI in a subprocess.

``launch_server(model, workdir, extra_args=(), startup_timeout=...)`` is a context manager:
it starts ``python -m mstar.cli serve MODEL --port <free> *extra_args`` (e.g. ``--config
FILE``) in its own process group, from ``workdir`` with its output in
``workdir/server.log``, waits for ``/health``, yields a ``Server``, and stops it (SIGTERM,
then SIGKILL to its whole process group) however the block ends. Test modules import it
with ``from live_server import launch_server`` (pytest puts this folder on sys.path); it is
not a conftest, so it never clashes with tests/server's conftest.

``serve_offline(model, workdir, config)`` launches the deployment ``config`` (a YAML mapping,
written to ``workdir``) with the Hugging Face hub offline: its checkpoint comes from a
hub-cache directory the test wrote.

``Uvicorn(app)`` serves an app (over an in-process deployment, say) from a background
thread of the test process instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml

DEFAULT_STARTUP_TIMEOUT_S = 240.0


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"(cannot read {self.log_path}: {err})"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a recycled group id we do not own
        return False
    return True


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (uvicorn shuts down, the workers are joined),
    then SIGKILL whatever of the group is still there."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


@contextmanager
def launch_server(model: str, workdir: Path, extra_args: Sequence[str] = (),
                  startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> Iterator[Server]:
    """A healthy ``mstar serve`` of ``model``; always stopped when the block ends."""
    log_path = workdir / "server.log"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MSTAR_API_KEY", None)  # it would make the server require a bearer token
    cmd = [sys.executable, "-m", "mstar.cli", "serve", model, "--port", str(port), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    live = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with code {proc.returncode} during startup; log tail:\n"
                            f"{live.log_tail()}")
            try:
                if httpx.get(f"{live.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become healthy in {startup_timeout:.0f} s; log tail:\n"
                            f"{live.log_tail()}")
            time.sleep(0.25)
        yield live
    finally:
        stop_server(proc)


@contextmanager
def serve_offline(model: str, workdir: Path, config: dict, extra_args: Sequence[str] = ()) -> Iterator[Server]:
    """``launch_server`` of ``config`` (written as ``<model>.yaml``) with ``HF_HUB_OFFLINE=1``."""
    (workdir / f"{model}.yaml").write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        with launch_server(model, workdir, ["--config", f"{model}.yaml", *extra_args]) as live:
            yield live


class Uvicorn:
    """The app on 127.0.0.1 at a free port, served from a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Uvicorn:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
