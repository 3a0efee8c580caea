"""End to end: ``replicas: 2`` of SmolLM2 on the local launcher (a worker process each).

One server for the module. Its two replicas split 32 concurrent greedy requests (the
``requests_routed`` series of /metrics, labelled by replica, counts both) and every answer
equals the same prompt's answer alone. Then one replica's worker process is killed while
both replicas stream: only that replica's requests fail (503 naming the rank), the other
replica's finish, a new request is served meanwhile, and /health is 200 again once the
worker is back.
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
CONFIG = {"model": MODEL, "max_seq_len": 512, "max_concurrent_requests": 32, "replicas": 2,
          "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 16}}}
PROMPTS = ["Name the capital of France.", "What is 2 + 2?", "Name a primary color.", "List three fruits.",
           "Which ocean is the biggest?", "What is the opposite of hot?", "Who wrote Hamlet?",
           "Give me one word that rhymes with cat."]
CLIENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("replicas-server")
    (workdir / "replicas.yaml").write_text(yaml.safe_dump(CONFIG))
    with launch_server(MODEL, workdir, ["--config", "replicas.yaml", "--max-worker-restarts", "1"]) as live:
        yield live


def _body(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


def _routed(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'^mstar_requests_routed\{replica="(\d+)"\} (\S+)$', text, re.M)}


def test_two_replicas_split_the_load_and_answer_as_alone(server: Server) -> None:
    alone = {}
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        for prompt in PROMPTS:
            response = client.post("/v1/chat/completions", json=_body(prompt, 16))
            assert response.status_code == 200, response.text
            alone[prompt] = response.json()["choices"][0]["message"]["content"]
    before = _routed(server)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=_body(PROMPTS[i % 8], 16))
                                          for i in range(32)))

    for i, response in enumerate(asyncio.run(run())):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == alone[PROMPTS[i % 8]], i
    after = _routed(server)
    split = {replica: after[replica] - before.get(replica, 0) for replica in after}
    assert set(split) == {"0", "1"} and sum(split.values()) == 32, split
    assert min(split.values()) >= 8, f"both replicas should take a share: {split}"
    health = httpx.get(f"{server.url}/health").json()
    assert [r["healthy"] for r in health["replicas"]] == [True, True], health


def test_a_dead_worker_fails_only_its_replica(server: Server) -> None:
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2, workers

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list:
        payloads = []
        try:
            body = _body("Tell me a long story about a dragon.", 160, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        data = line[len("data:"):].strip()
                        payloads.append(data if data == "[DONE]" else json.loads(data))
                        if len(payloads) >= 2:
                            started.set()
        finally:
            started.set()
        return payloads

    async def run() -> tuple[list, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(stream(client, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            os.kill(workers[0], signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.sleep(1.0)  # the conductor notices the dead process
            fresh = await client.post("/v1/chat/completions", json=_body(PROMPTS[0], 8))
            return await asyncio.gather(*tasks), fresh, killed

    streams, fresh, killed = asyncio.run(run())
    assert fresh.status_code == 200, fresh.text  # the healthy replica took it
    failed = [p for p in streams if "error" in p[-2]]
    finished = [p for p in streams if p[-2].get("choices") and p[-2]["choices"][0].get("finish_reason") == "length"]
    assert len(failed) == 2 and len(finished) == 2, [p[-2] for p in streams]
    for payloads in failed:
        assert "worker rank 0" in payloads[-2]["error"]["message"], payloads[-2]
    health = httpx.get(f"{server.url}/health")
    if health.status_code == 503:  # still restarting: it names the replica
        assert "replica" in health.json()["error"]["message"], health.text
    deadline = time.monotonic() + 90
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, f"the worker did not come back; log:\n{server.log_tail()}"
        time.sleep(0.5)
    assert time.monotonic() - killed < 120
    health = httpx.get(f"{server.url}/health").json()
    assert [r["healthy"] for r in health["replicas"]] == [True, True], health
