"""``replicas: 2`` with ``backend: ray`` on the two-node test cluster: each replica's rank is
a Ray actor on the worker node. Eight concurrent greedy requests are split between the
replicas and each answer equals its answer alone; then one replica's actor is killed: its
open request fails naming the rank and node, while the other replica keeps answering."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="backend: ray needs the ray extra (pip install -e .[ray])")
from ray.cluster_utils import Cluster  # noqa: E402

from mstar.config import parse_config  # noqa: E402
from mstar.contract import ChatSpec, SamplingParams  # noqa: E402
from mstar.runtime.launch import Deployment, start  # noqa: E402
from tests.support.ray_cluster import two_node_cluster  # noqa: E402

MODEL = "smollm2"
WORKER_NODE = "mstar_test_worker_node"
QUESTIONS = ["Name the capital of France.", "What colour is the sky?", "What is 2 + 2?", "Name a fruit."]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(2, WORKER_NODE) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[Deployment]:
    node_groups = [{"node_names": ["llm"], "ranks": [0], "ray_resources": {WORKER_NODE: 1}}]
    config = {"model": MODEL, "max_seq_len": 256, "max_concurrent_requests": 8, "replicas": 2,
              "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}},
              "backend": "ray", "ray_address": cluster.address, "node_groups": node_groups}
    d = start(parse_config(config), max_worker_restarts=0)
    try:
        yield d
    finally:
        d.close()


async def _answer(deployment: Deployment, question: str, max_tokens: int = 12) -> tuple[str, str | None]:
    spec = ChatSpec(request_id=f"q-{uuid.uuid4().hex}", messages=[{"role": "user", "content": question}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=max_tokens > 12)
    parts = []
    async for event in deployment.backend.chat(spec):
        if event.error is not None:
            return "".join(parts), event.error
        parts.append(event.text)
    return "".join(parts), None


def test_replicas_split_the_load_and_answer_as_alone(deployment: Deployment) -> None:
    alone = {q: asyncio.run(_answer(deployment, q)) for q in QUESTIONS}
    before = list(deployment.runtime.routed)

    async def together():
        return await asyncio.gather(*(_answer(deployment, QUESTIONS[i % 4]) for i in range(8)))

    for i, got in enumerate(asyncio.run(together())):
        assert got == alone[QUESTIONS[i % 4]] and got[1] is None, (i, got)
    split = [after - b for after, b in zip(deployment.runtime.routed, before, strict=True)]
    assert sum(split) == 8 and min(split) >= 2, split


def test_a_dead_actor_fails_only_its_replica(cluster: Cluster, deployment: Deployment) -> None:
    """Last: it kills replica 0's rank (no restarts)."""
    replica0 = deployment.runtime.replicas[0]

    async def run():
        long = [asyncio.create_task(_answer(deployment, "Tell me a long story.", 120)) for _ in range(2)]
        while not all(r.tracked and r.conductor.num_live for r in deployment.runtime.replicas):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        ray.kill(replica0.workers.ranks[0].proc.actor, no_restart=True)
        results = await asyncio.gather(*long)
        fresh = await _answer(deployment, QUESTIONS[0])
        return results, fresh

    results, fresh = asyncio.run(run())
    errors = [error for _, error in results if error is not None]
    assert len(errors) == 1, results
    assert "rank 0" in errors[0] and cluster.worker_node_id[:8] in errors[0], errors
    assert fresh[1] is None and fresh[0].strip(), fresh  # replica 1 still answers
    assert not deployment.runtime.healthy and "replica 0" in deployment.runtime.failure
