"""A lost node under ``backend: ray``: ``replicas: 2`` of SmolLM2 on a three-node test
cluster, each replica's rank on a worker node of its own. Mid-load replica 0's node goes as a
machine does: every process its raylet started (the rank's actor among them) is frozen and
the raylet is killed (Ray itself declares that node dead only ~16 s later). Frozen, the rank
cannot finish its request before the server notices, however fast it decodes. Replica 0's open
request gets a 503 naming the node within 5 s of the kill, measured by the client (by
whichever sign comes first: its heartbeats running out, or Ray finding its actor
unreachable), while replica 1 finishes its own and answers every new request. A node with room joins, Ray
moves replica 0's bundle there once it has given the old node up, the restarted rank
rejoins, and the deployment is healthy again, answering as before."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="backend: ray needs the ray extra (pip install -e .[ray])")
from ray.cluster_utils import Cluster  # noqa: E402

from mstar.config import parse_config  # noqa: E402
from mstar.contract import ChatSpec, SamplingParams  # noqa: E402
from mstar.runtime.launch import Deployment, start  # noqa: E402
from tests.support.ray_cluster import add_worker_node, two_node_cluster  # noqa: E402

MODEL = "smollm2"
WORKER_NODE = "mstar_test_lost_node"
QUESTIONS = ["Name the capital of France.", "What colour is the sky?", "What is 2 + 2?"]
DETECT_S = 5.0  # the bound: from the kill to the client's 503
REJOIN_S = 90.0  # Ray gives the node up (~16 s), then the new actor starts and loads


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(1, WORKER_NODE, worker_nodes=2) as cluster:  # one CPU, one replica per node
        yield cluster


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[Deployment]:
    node_groups = [{"node_names": ["llm"], "ranks": [0], "ray_resources": {WORKER_NODE: 1}}]
    config = {"model": MODEL, "max_seq_len": 256, "max_concurrent_requests": 4, "replicas": 2,
              "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}},
              "backend": "ray", "ray_address": cluster.address, "node_groups": node_groups}
    d = start(parse_config(config), max_worker_restarts=1)
    try:
        yield d
    finally:
        d.close()


async def _answer(deployment: Deployment, question: str, max_tokens: int = 12) -> dict:
    """The answer's text, its error and HTTP status if it failed, and when it ended."""
    spec = ChatSpec(request_id=f"q-{uuid.uuid4().hex}", messages=[{"role": "user", "content": question}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=max_tokens > 12)
    parts = []
    async for event in deployment.backend.chat(spec):
        if event.error is not None:
            return {"text": "".join(parts), "error": event.error, "status": event.error_status,
                    "ended": time.monotonic()}
        parts.append(event.text)
    return {"text": "".join(parts), "error": None, "status": 200, "ended": time.monotonic()}


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from ``/proc``."""
    kids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: the parent
            kids.append(int(entry))
    return kids


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_lost_node_fails_its_replica_within_5s_and_its_rank_rejoins(cluster: Cluster,
                                                                       deployment: Deployment) -> None:
    replicas = deployment.runtime.replicas
    nodes = [r.workers.layout.node_of(0) for r in replicas]
    assert sorted(nodes) == sorted(n.node_id for n in cluster.workers), "one replica per worker node"
    lost = next(n for n in cluster.workers if n.node_id == nodes[0])
    raylet = lost.all_processes["raylet"][0].process.pid
    alone = asyncio.run(_answer(deployment, QUESTIONS[0]))  # both idle: replica 0 takes it
    assert alone["error"] is None, alone

    async def run():
        long = [asyncio.create_task(_answer(deployment, "Tell me a long story.", 160)) for _ in range(2)]
        while not all(r.tracked and r.conductor.num_live for r in replicas):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        _signal(frozen, signal.SIGSTOP)  # the node's processes stop as the machine would
        os.kill(raylet, signal.SIGKILL)
        killed = time.monotonic()
        done, _ = await asyncio.wait(long, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done, "no request ended within 30 s of the kill"
        fresh = [await _answer(deployment, q) for q in QUESTIONS]  # replica 0 is out: replica 1 takes them
        return [await task for task in long], fresh, killed

    frozen = _children(raylet)
    assert frozen, "the raylet started no process"
    try:
        results, fresh, killed = asyncio.run(run())
    finally:
        _signal(frozen, signal.SIGKILL)
    failed = [r for r in results if r["error"] is not None]
    assert len(failed) == 1, results
    error = failed[0]["error"]
    assert failed[0]["status"] == 503 and "rank 0" in error and nodes[0][:8] in error, error
    assert "was lost" in error, error  # by silence, or by Ray's word that the actor is unreachable
    assert failed[0]["ended"] - killed < DETECT_S, f"the 503 came {failed[0]['ended'] - killed:.1f} s after the kill"
    assert [r["error"] for r in fresh] == [None] * len(QUESTIONS), fresh
    assert not deployment.runtime.healthy and "replica 0" in deployment.runtime.failure

    newcomer = add_worker_node(cluster, 1, WORKER_NODE)  # room for the rank, once Ray gives the old node up
    deadline = time.monotonic() + REJOIN_S
    while not deployment.runtime.healthy:
        assert time.monotonic() < deadline, f"replica 0 did not come back: {deployment.runtime.failure}"
        time.sleep(0.5)
    assert replicas[0].workers.ranks[0].proc.node == newcomer.node_id
    again = asyncio.run(_answer(deployment, QUESTIONS[0]))  # both idle again: replica 0 takes it
    assert (again["text"], again["error"]) == (alone["text"], None), again
    assert deployment.runtime.routed[0] >= 2
