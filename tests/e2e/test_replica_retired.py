"""End to end: ``replicas: 2`` of SmolLM2 on the local launcher with
``--max-worker-restarts 0``. One replica's worker process is killed while both replicas
stream: that replica has no restart left, so it stays out of rotation (its requests fail
with a 503 naming the rank, /health is 503 listing it, ``mstar_replica_healthy`` is 0 for
it), while the server keeps running and the other replica answers every new request.
(With one replica the server stops instead: ``test_worker_faults.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml
from live_server import Server, launch_server
from test_worker_faults import _worker_pids

MODEL = "smollm2"
CONFIG = {"model": MODEL, "max_seq_len": 512, "max_concurrent_requests": 8, "replicas": 2,
          "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 16}}}
PROMPTS = ["Name the capital of France.", "What is 2 + 2?", "Who wrote Hamlet?", "Name a primary color."]
CLIENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("retired-replica-server")
    (workdir / "replicas.yaml").write_text(yaml.safe_dump(CONFIG))
    with launch_server(MODEL, workdir, ["--config", "replicas.yaml", "--max-worker-restarts", "0"]) as live:
        yield live


def _body(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> dict:
    """A long streamed answer: its last payload before [DONE] (an error or the finish)."""
    last: dict = {}
    try:
        body = _body("Tell me a long story about a dragon.", 160, ignore_eos=True, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            seen = 0
            async for line in response.aiter_lines():
                data = line[len("data:"):].strip() if line.startswith("data:") else ""
                if data and data != "[DONE]":
                    last, seen = json.loads(data), seen + 1
                    if seen >= 2:
                        started.set()
    finally:
        started.set()
    return last


def test_a_replica_out_of_restarts_stays_out_while_the_other_serves(server: Server) -> None:
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2, workers

    async def run() -> tuple[list[dict], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(_stream(client, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            os.kill(workers[0], signal.SIGKILL)
            streams = await asyncio.gather(*tasks)
            fresh = [await client.post("/v1/chat/completions", json=_body(p, 8)) for p in PROMPTS]
            return streams, fresh

    streams, fresh = asyncio.run(run())
    failed = [s for s in streams if "error" in s]
    finished = [s for s in streams if s.get("choices") and s["choices"][0].get("finish_reason") == "length"]
    assert len(failed) == 2 and len(finished) == 2, streams
    for last in failed:
        assert "worker rank 0" in last["error"]["message"], last
    assert [r.status_code for r in fresh] == [200] * len(PROMPTS), [r.text for r in fresh]

    time.sleep(1.0)  # no restart is coming: the server must still be up, with one replica out
    assert server.proc.poll() is None, f"the server stopped; log:\n{server.log_tail()}"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503, health.text
    replicas = health.json()["replicas"]
    out = [r for r in replicas if not r["healthy"]]
    assert len(out) == 1 and sum(r["healthy"] for r in replicas) == 1, replicas
    assert "out of rotation" in out[0]["failure"] and "--max-worker-restarts 0" in out[0]["failure"], out
    assert f"replica {out[0]['replica']}" in health.json()["error"]["message"], health.text
    metrics = httpx.get(f"{server.url}/metrics").text
    healthy = dict(re.findall(r'^mstar_replica_healthy\{replica="(\d+)"\} (\S+)$', metrics, re.M))
    assert healthy == {str(out[0]["replica"]): "0.0", str(1 - out[0]["replica"]): "1.0"}, healthy
    again = httpx.post(f"{server.url}/v1/chat/completions", json=_body(PROMPTS[0], 8), timeout=CLIENT_TIMEOUT_S)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == \
        fresh[0].json()["choices"][0]["message"]["content"], again.text
