"""``backend: ray`` on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head
node and one worker node on this machine, CPU resources only).

SmolLM2 (embedded weights) is served with its one rank forced onto the worker node by a
custom resource only that node has; the conductor and the API server stay in this process.
Its greedy answers through the official ``openai`` client equal the local launcher's
(the in-process runtime), and the rank's actor really sits on the worker node. Killing the
actor fails the open request at once with an error naming the rank and its node.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import openai
import pytest

ray = pytest.importorskip("ray", reason="backend: ray needs the ray extra (pip install -e .[ray])")
from live_server import Uvicorn  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from mstar.config import ConfigError, parse_config  # noqa: E402
from mstar.contract import GenerateSpec  # noqa: E402
from mstar.runtime.launch import Deployment, start  # noqa: E402
from mstar.server.app import create_app  # noqa: E402
from tests.support.ray_cluster import two_node_cluster  # noqa: E402

MODEL = "smollm2"
WORKER_NODE = "mstar_test_worker_node"  # a custom resource only the worker node has
QUESTIONS = ["Name the capital of France.", "What colour is the sky?"]
MAX_TOKENS = 12


def _config(**extra) -> dict:
    return {"model": MODEL, "max_seq_len": 256, "max_concurrent_requests": 4,
            "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}}, **extra}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(1, WORKER_NODE) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """The local launcher's greedy answers (in-process: the same engines, no Ray)."""
    local = start(parse_config(_config()), in_process=True)
    try:
        return [_answer(local, q) for q in QUESTIONS]
    finally:
        local.close()


@pytest.fixture(scope="module")
def deployment(cluster: Cluster, expected: list[str]) -> Iterator[Deployment]:
    node_groups = [{"node_names": ["llm"], "ranks": [0], "ray_resources": {WORKER_NODE: 1}}]
    d = start(parse_config(_config(backend="ray", ray_address=cluster.address, node_groups=node_groups)),
              max_worker_restarts=0)
    try:
        yield d
    finally:
        d.close()


def _answer(deployment: Deployment, question: str) -> str:
    async def run() -> str:
        spec = GenerateSpec(f"ref-{uuid.uuid4().hex}", question, [], ["text"],
                            {"temperature": 0, "max_tokens": MAX_TOKENS})
        parts = []
        async for event in deployment.backend.generate(spec):
            assert event.error is None, event.error
            parts.append(event.text)
        return "".join(parts)

    return asyncio.run(run())


def test_rank_runs_on_the_worker_node(cluster: Cluster, deployment: Deployment) -> None:
    layout = deployment.runtime.workers.layout
    assert layout.node_of(0) == cluster.worker_node_id != layout.server_node
    assert layout.protocol == "SHM+TCP"  # shared memory stops at a node
    assert deployment.runtime.transport.via(0) == "tcp"


def test_openai_client_gets_the_local_launchers_text(deployment: Deployment, expected: list[str]) -> None:
    with Uvicorn(create_app(deployment.backend, served_model_names=[MODEL])) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for question, want in zip(QUESTIONS, expected, strict=True):
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=MAX_TOKENS)
            assert chat.choices[0].message.content == want and want.strip()


def test_ray_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"node_groups\[0\]\.ray_resources"):
        parse_config(_config(node_groups=[{"node_names": ["llm"], "ranks": [0], "ray_resources": {"x": 1}}]))
    with pytest.raises(ConfigError, match="in-process"):
        start(parse_config(_config(backend="ray")), in_process=True)


def test_a_dead_actor_fails_its_request_naming_rank_and_node(cluster: Cluster, deployment: Deployment) -> None:
    """Last: it kills the deployment's only rank (no restarts)."""

    async def run() -> tuple[str | None, float]:
        spec = GenerateSpec(f"kill-{uuid.uuid4().hex}", "Tell me a very long story.", [], ["text"],
                            {"temperature": 0, "max_tokens": 200})
        killed_at = None
        async for event in deployment.backend.generate(spec):
            if event.error is not None:
                return event.error, time.monotonic() - killed_at
            if killed_at is None and event.text:
                ray.kill(deployment.runtime.workers.ranks[0].proc.actor, no_restart=True)
                killed_at = time.monotonic()
        return None, 0.0

    error, after = asyncio.run(run())
    assert error is not None, "the request outlived its worker"
    assert "rank 0" in error and cluster.worker_node_id[:8] in error, error
    print(f"failed {after:.2f} s after the kill: {error}")
    assert after < 10.0
