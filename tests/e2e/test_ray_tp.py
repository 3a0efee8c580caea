"""``backend: ray`` with a split node group: a tiny Llama at TP=2 (gloo on the CPU), both
ranks in one STRICT_PACK placement group on a worker node of a local Ray cluster (not the
server's node), answers a greedy chat exactly as the in-process TP=1 deployment does. The
two ranks meet at a TCP rendezvous on their own node; the frontend reaches the leader over
TCP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ray = pytest.importorskip("ray", reason="backend: ray needs the ray extra (pip install -e .[ray])")
from ray.cluster_utils import Cluster  # noqa: E402

from mstar.config import parse_config  # noqa: E402
from mstar.runtime.launch import start  # noqa: E402
from mstar.server.app import create_app  # noqa: E402
from tests.distributed.test_tp_runtime import TP2, write_tiny_llama  # noqa: E402
from tests.support.ray_cluster import two_node_cluster  # noqa: E402

WORKER_NODE = "mstar_test_tp_node"  # a custom resource only the worker node has
BODY = {"model": "llama", "messages": [{"role": "user", "content": "Where is the bridge?"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _config(model_dir: Path, **extra) -> dict:
    return {"model": "llama", "model_path": str(model_dir), "dtype": "float32", "max_seq_len": 128,
            "max_concurrent_requests": 4, "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}},
            **extra}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(2, WORKER_NODE) as cluster:
        yield cluster


def _chat(deployment) -> dict:
    with TestClient(create_app(deployment.backend)) as client:
        response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200, response.text
    return response.json()


def test_tp2_on_a_worker_node_answers_as_tp1(cluster: Cluster, tmp_path: Path) -> None:
    model_dir = write_tiny_llama(tmp_path / "model")
    tp1 = start(parse_config(_config(model_dir)), in_process=True)
    try:
        expected = _chat(tp1)
    finally:
        tp1.close()
    assert expected["usage"]["completion_tokens"] == BODY["max_tokens"]
    groups = [{**TP2[0], "ray_resources": {WORKER_NODE: 1}}]
    tp2 = start(parse_config(_config(model_dir, backend="ray", node_groups=groups)), max_worker_restarts=0)
    try:
        layout = tp2.runtime.workers.layout
        assert layout.node_of(0) == layout.node_of(1) == cluster.worker_node_id != layout.server_node
        assert tp2.runtime.transport.via(0) == "tcp"
        for _ in range(2):  # the second runs on the KV pages the first gave back
            answer = _chat(tp2)
            assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
            assert answer["usage"] == expected["usage"]
    finally:
        tp2.close()


def test_tp2_spread_over_two_nodes_answers_as_tp1(cluster: Cluster, tmp_path: Path) -> None:
    """``ray_placement: strict_spread``: one rank on the head node, one on the worker node;
    gloo and the tensors between them over TCP."""
    model_dir = write_tiny_llama(tmp_path / "model")
    tp1 = start(parse_config(_config(model_dir)), in_process=True)
    try:
        expected = _chat(tp1)
    finally:
        tp1.close()
    groups = [{**TP2[0], "ray_placement": "strict_spread"}]
    tp2 = start(parse_config(_config(model_dir, backend="ray", node_groups=groups)), max_worker_restarts=0)
    try:
        layout = tp2.runtime.workers.layout
        assert {layout.node_of(0), layout.node_of(1)} == {cluster.worker_node_id, layout.server_node}
        answer = _chat(tp2)
        assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert answer["usage"] == expected["usage"]
    finally:
        tp2.close()


def test_ray_placement_is_checked() -> None:
    from mstar.config import ConfigError

    with pytest.raises(ConfigError, match=r"node_groups\[0\].ray_placement: only backend: ray"):
        parse_config(_config(Path("x"), node_groups=[{**TP2[0], "ray_placement": "spread"}]))
    single = {"node_names": ["llm"], "ranks": [0], "ray_placement": "spread"}
    with pytest.raises(ConfigError, match=r"node_groups\[0\].ray_placement: only a split group"):
        parse_config(_config(Path("x"), backend="ray", node_groups=[single]))
    with pytest.raises(ConfigError, match="ray_placement"):
        parse_config(_config(Path("x"), backend="ray", node_groups=[{**TP2[0], "ray_placement": "diagonal"}]))
