"""End to end: the real ``mstar serve smollm2 --timeout 20 --max-worker-restarts 1`` CLI
(a worker process) facing timeouts and a worker process that dies under load.

The tests run in order on one server. The timeout test runs first; then the worker process
is SIGKILLed while streaming and plain requests are in flight: each must fail with a 503
naming the worker within 5 s (in band for a stream that has started), /health must turn
503 naming it, new requests must get a 503 at once, and no client may hang. The server
restarts the worker: /health turns 200 again and a new request is answered. Killed once
more, with its one restart used, the server fails what is in flight and exits with status
1. This module has a server of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import Server, launch_server

MODEL = "smollm2"
TIMEOUT_S = 20.0  # long enough for the killed requests to start on a busy machine
FAIL_WITHIN_S = 5.0
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--timeout", str(TIMEOUT_S), "--max-worker-restarts", "1"]
    with launch_server(MODEL, tmp_path_factory.mktemp("faults-server"), args) as live:
        yield live


def _body(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


LONG = _body("Tell me a very long story about a dragon.", 1500, ignore_eos=True)


def _sse(text: str) -> list:
    payloads = [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def _worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes: its children started by multiprocessing's spawn."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # field 4 of stat: the parent's pid
        if parent == server_pid and "spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_timeout_from_the_command_line(server: Server) -> None:
    async def run() -> tuple[httpx.Response, list, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            started = time.monotonic()
            plain, streamed = await asyncio.gather(
                client.post("/v1/chat/completions", json=LONG),
                client.post("/v1/chat/completions", json={**LONG, "stream": True}))
            return plain, streamed, time.monotonic() - started

    plain, streamed, elapsed = asyncio.run(run())
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    assert plain.status_code == 504, plain.text
    assert plain.json()["error"]["message"] == "request timed out"
    assert streamed.status_code == 200
    payloads = _sse(streamed.text)
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["message"] == "request timed out"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_killed_worker_fails_requests_with_503_and_no_client_hangs(server: Server) -> None:
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 1, workers
    worker = workers[0]

    async def stream_until_failure(client: httpx.AsyncClient, first_chunk: asyncio.Event) -> tuple[list, float]:
        payloads = []
        try:
            async with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        data = line[len("data:"):].strip()
                        payloads.append(data if data == "[DONE]" else json.loads(data))
                        if len(payloads) >= 2:  # the role chunk, then the first token
                            first_chunk.set()
        finally:
            first_chunk.set()  # a stream that failed to start must not leave the test waiting
        return payloads, time.monotonic()

    async def plain(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        response = await client.post("/v1/chat/completions", json=LONG)
        return response, time.monotonic()

    async def run() -> tuple[list, list, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream_until_failure(client, event)) for event in started]
            plains = [asyncio.create_task(plain(client)) for _ in range(3)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            for task in streams:  # all streaming; the plain ones were prefilled in the same batch
                if task.done():
                    task.result()  # raises why it ended early
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            # every client gets its answer; none hangs (the client timeouts are the backstop)
            done = await asyncio.wait_for(asyncio.gather(*streams, *plains), FAIL_WITHIN_S + 10)
            return done[:3], done[3:], killed

    streamed, answered, killed = asyncio.run(run())
    for payloads, finished in streamed:
        assert finished - killed < FAIL_WITHIN_S
        assert payloads[-1] == "[DONE]"
        error = payloads[-2]["error"]
        assert error["type"] == "server_error" and "worker rank 0 failed" in error["message"], error
        assert f"pid {worker}" in error["message"] and "SIGKILL" in error["message"]
    for response, finished in answered:
        assert finished - killed < FAIL_WITHIN_S
        assert response.status_code == 503, response.text
        assert "worker rank 0 failed" in response.json()["error"]["message"]

    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503
    assert "worker rank 0 failed" in health.json()["error"]["message"]
    assert f"pid {worker}" in health.json()["error"]["message"]
    started = time.monotonic()
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=_body("Hello?", 8), timeout=5)
    assert refused.status_code == 503 and time.monotonic() - started < 2
    assert "worker rank 0 failed" in refused.json()["error"]["message"]
    metrics = httpx.get(f"{server.url}/metrics", timeout=5)
    assert metrics.status_code == 200 and "mstar_healthy 0.0" in metrics.text
    assert server.proc.poll() is None  # the API server itself stays up to report it


def _wait_healthy(server: Server, timeout: float = 240.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{server.url}/health", timeout=5)
        if health.status_code == 200 or time.monotonic() > deadline:
            return health
        time.sleep(0.25)


def test_the_killed_worker_is_restarted_and_serves_again(server: Server) -> None:
    health = _wait_healthy(server)
    assert health.status_code == 200, f"{health.text}\n{server.log_tail()}"
    assert "restarting worker rank 0" in server.log_tail(200_000)
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=CLIENT_TIMEOUT_S,
                        json=_body("Name the capital of France.", 16))
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    assert len(_worker_pids(server.proc.pid)) == 1


def test_with_restarts_used_up_a_dead_worker_shuts_the_server_down(server: Server) -> None:
    (worker,) = _worker_pids(server.proc.pid)

    async def run() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            lines: list[str] = []
            first = asyncio.Event()

            async def stream() -> None:
                async with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line)
                            if len(lines) >= 2:
                                first.set()

            streaming = asyncio.create_task(stream())
            plain = asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
            await asyncio.wait_for(first.wait(), 60)
            os.kill(worker, signal.SIGKILL)
            _, response = await asyncio.wait_for(asyncio.gather(streaming, plain), FAIL_WITHIN_S + 10)
            return lines, response

    lines, response = asyncio.run(run())
    assert response.status_code == 503, response.text
    assert "restarted 1 time(s) already" in response.json()["error"]["message"]
    assert lines[-1] == "data: [DONE]" and "worker rank 0 failed" in lines[-2]
    try:
        code = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after giving up; log tail:\n{server.log_tail()}")
    assert code == 1, server.log_tail()
    assert "the server shut down" in server.log_tail()
    assert not _worker_pids(server.proc.pid)
