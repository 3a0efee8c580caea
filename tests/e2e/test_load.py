"""End to end under load: the real default ``mstar serve smollm2 --log-stats`` (a worker
process; 16 running, 64 waiting) with 200 chat requests from 64 concurrent clients, then
50 streams whose clients leave at random points. Nothing may be lost, lengths must hold,
and afterwards every KV page is free again (read from /metrics) and the server serves.
Also: the default bind address is the loopback, and --log-stats logs every request.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import Server, launch_server
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
CHAT = "/v1/chat/completions"
TOPICS = ["the sea", "a cat", "Paris", "rain", "numbers", "the moon", "bread", "music", "trains", "snow"]
ASKS = ["Write one sentence about {}.", "Name a fact about {}.", "What rhymes with {}?", "Describe {} briefly."]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(MODEL, tmp_path_factory.mktemp("load-server"), ["--log-stats"]) as live:
        yield live


def _prompt(i: int) -> str:
    return f"{ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)])} (#{i})"


def _body(content: str, max_tokens: int, **extra) -> dict:
    # a short system message: the default one would double every prompt's prefill
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}


def _metrics(server: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_all_free(server: Server, timeout: float = 30.0) -> dict[tuple[str, tuple], float]:
    """Poll /metrics until no request runs or waits and every KV pool is full again."""
    deadline = time.monotonic() + timeout
    while True:
        samples = _metrics(server)
        used = {k: v for k, v in samples.items() if k[0] == "mstar_kv_pages_used"}
        quiet = samples[("mstar_requests_running", ())] == 0 and samples[("mstar_requests_waiting", ())] == 0
        if (quiet and used and all(v == 0 for v in used.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert used and all(v == 0 for v in used.values()), f"KV pages still in use: {used}"
    assert quiet, {k: v for k, v in samples.items() if k[0].startswith("mstar_requests_")}
    for (name, labels), total in samples.items():
        if name == "mstar_kv_pages_total":
            assert total > 0 and samples[("mstar_kv_pages_used", labels)] == 0
    assert samples[("mstar_sequences", (("node", "llm"), ("rank", "0")))] == 0
    return samples


def test_binds_the_loopback_by_default(server: Server) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    assert f"on http://127.0.0.1:{port} (Ctrl-C to stop)" in server.log_tail(200_000)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                listening.append(address)
    assert listening == ["0100007F"], listening  # 127.0.0.1 only (little-endian hex)


def test_200_requests_at_64_concurrent_all_complete(server: Server) -> None:
    n, concurrency = 200, 64

    async def run() -> list[tuple[int, int, dict]]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            async def one(i: int) -> tuple[int, int, dict]:
                max_tokens = 1 + i % 8
                async with gate:
                    response = await client.post(CHAT, json=_body(_prompt(i), max_tokens))
                return max_tokens, response.status_code, response.json()

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 600)

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert len(results) == n
    assert [status for _, status, _ in results] == [200] * n, [b for _, s, b in results if s != 200][:3]
    assert len({body["id"] for _, _, body in results}) == n  # none lost, none answered twice
    for max_tokens, _, body in results:
        choice, usage = body["choices"][0], body["usage"]
        assert choice["finish_reason"] in ("stop", "length"), body
        assert 0 < usage["completion_tokens"] <= max_tokens, (max_tokens, body)
        if choice["finish_reason"] == "length":
            assert usage["completion_tokens"] == max_tokens
        assert usage["prompt_tokens"] > 0
    samples = _wait_all_free(server)
    ok = ("mstar_http_requests_total", (("method", "POST"), ("route", CHAT), ("status", "200")))
    assert samples[ok] == n
    assert samples[("mstar_time_to_first_output_seconds_count", (("route", CHAT),))] == n
    assert samples[("mstar_http_request_duration_seconds_count", (("route", CHAT),))] == n
    print(f"200 requests at 64 concurrent in {elapsed:.1f} s")

    # --log-stats: one line per request as it finishes, with its reason and time per node
    logged = {request_id: (reason, float(ms)) for request_id, reason, ms in re.findall(
        r"request (chatcmpl-\w+) finished \((\w+)\): llm (\d+\.\d) ms", server.log_tail(10_000_000))}
    for _, _, body in results:
        reason, ms = logged[body["id"]]
        assert reason == body["choices"][0]["finish_reason"] and ms > 0


def test_50_streams_left_at_random_points_free_every_page(server: Server) -> None:
    rng = random.Random(1234)
    leave_after = [rng.randint(0, 12) for _ in range(50)]  # content chunks read before leaving

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            async def one(i: int, chunks: int) -> int:
                body = _body(f"Tell me a long story about {TOPICS[i % len(TOPICS)]}.", 64, ignore_eos=True,
                             stream=True)
                seen = 0
                async with client.stream("POST", CHAT, json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data:") and '"content"' in line:
                            seen += 1
                            if seen > chunks:
                                break  # leaving the block closes the connection mid-stream
                return seen

            return await asyncio.wait_for(asyncio.gather(*(one(i, k) for i, k in enumerate(leave_after))), 300)

    seen = asyncio.run(run())
    assert all(s == k + 1 for s, k in zip(seen, leave_after)), (seen, leave_after)
    _wait_all_free(server)
    cancelled = re.findall(r"request chatcmpl-\w+ finished \(cancelled\)", server.log_tail(10_000_000))
    assert len(cancelled) == 50
    # and it still serves, correctly
    response = httpx.post(f"{server.url}{CHAT}", json=_body("Name the capital of France.", 16), timeout=60)
    assert response.status_code == 200 and "Paris" in response.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert server.proc.poll() is None
