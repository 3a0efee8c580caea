"""Orpheus under ``backend: ray`` with its talker and its codec on two different worker nodes
of a local test cluster (a custom resource on each node pins each rank) gives the samples
of the colocated in-process deployment: the audio codes cross between the nodes over TCP
(``shm+tcp`` picks TCP for the pair), the audio reaches the server from the codec's node.
The checkpoints are the tiny random ones of ``test_orpheus_transports.py`` (a talker that
speaks audio codes only, a real SNAC layout), so every request carries many SNAC frames."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="backend: ray needs the ray extra (pip install -e .[ray])")
snac = pytest.importorskip("snac")
from ray.cluster_utils import Cluster  # noqa: E402
from test_orpheus_transports import write_checkpoints  # noqa: E402

from mstar.config import parse_config  # noqa: E402
from mstar.contract import SpeechSpec  # noqa: E402
from mstar.model.speech_output import pcm_to_array  # noqa: E402
from mstar.runtime.launch import start  # noqa: E402
from tests.support.ray_cluster import add_worker_node, two_node_cluster  # noqa: E402

TALKER_NODE, CODEC_NODE = "mstar_test_talker_node", "mstar_test_codec_node"
SEEDS = (5, 6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("orpheus-ray"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(1, TALKER_NODE) as cluster:
        cluster.codec_node = add_worker_node(cluster, 1, CODEC_NODE)
        yield cluster


def _config(checkpoint: tuple[Path, Path], ranks: tuple[int, int], **extra) -> dict:
    talker, codec = checkpoint
    groups = [{"node_names": ["llm"], "ranks": [ranks[0]]}, {"node_names": ["snac_decoder"], "ranks": [ranks[1]]}]
    if extra.get("backend") == "ray":
        groups[0]["ray_resources"] = {TALKER_NODE: 1}
        groups[1]["ray_resources"] = {CODEC_NODE: 1}
    return {"model": "orpheus", "model_path": str(talker), "max_seq_len": 2048, "max_concurrent_requests": 4,
            "dtype": "float32", "node_groups": groups,
            "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 16}},
            "model_kwargs": {"max_new_tokens": 140, "benchmark_audio_only": True, "snac_path": str(codec)}, **extra}


def _speak(deployment, seed: int) -> np.ndarray:
    spec = SpeechSpec(f"speak-{seed}", "Hello from M star.", "tara", 1.0, {"seed": seed, "temperature": 0.8})

    async def run():
        return [event async for event in deployment.backend.speech(spec)]

    events = asyncio.run(run())
    assert all(e.error is None for e in events), [e.error for e in events if e.error]
    return pcm_to_array(events)


def test_talker_and_codec_on_two_nodes_speak_the_colocated_audio(checkpoint, cluster: Cluster) -> None:
    colocated = start(parse_config(_config(checkpoint, (0, 0))), in_process=True)
    try:
        want = [_speak(colocated, seed) for seed in SEEDS]
    finally:
        colocated.close()
    assert len(want[0]) == 140 // 7 * 2048 and np.abs(want[0]).max() > 0  # 20 SNAC frames, not silence

    split = start(parse_config(_config(checkpoint, (0, 1), backend="ray", ray_address=cluster.address)))
    try:
        layout = split.runtime.workers.layout
        assert layout.node_of(0) == cluster.worker_node_id and layout.node_of(1) == cluster.codec_node.node_id
        assert layout.protocol == "SHM+TCP" and split.runtime.workers.protocol_name == "SHM+TCP"
        got = [_speak(split, seed) for seed in SEEDS]
    finally:
        split.close()
    for seed, a, b in zip(SEEDS, got, want, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), f"seed {seed}: max diff {np.abs(a - b).max()}"
