"""How ``backend: ray`` turns node groups into placement-group bundles (no cluster needed):
each rank's bundle, which ranks share a placement group, and with which strategy; the two
example configs of docs/multinode.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar.config import ConfigError, load_config, parse_config
from mstar.model.llama.model import LlamaChat
from mstar.runtime.placement import build_placement
from mstar.runtime.ray_workers import pack_strategy, packs, rank_bundles

CONFIGS = Path(__file__).parents[2] / "configs"


def _layout(config):
    placement = build_placement(LlamaChat(config).graph(), config)
    return [(ranks, pack_strategy(config, ranks)) for ranks in packs(placement, config.num_ranks)]


def test_the_orpheus_example_puts_talker_and_codec_on_their_nodes():
    config = load_config(CONFIGS / "orpheus_ray_two_nodes.yaml")
    assert config.backend == "ray" and config.num_ranks == 2
    assert rank_bundles(config, 2) == {0: {"CPU": 1.0, "GPU": 1.0, "talker_box": 1.0},
                                       1: {"CPU": 1.0, "GPU": 1.0, "codec_box": 1.0}}


def test_a_split_group_is_one_strict_pack_unless_it_asks_otherwise():
    config = load_config(CONFIGS / "llama_tp2_ray.yaml")
    assert _layout(config) == [([0, 1], "STRICT_PACK")]
    data = config.model_dump(exclude_unset=True)
    data["node_groups"] = [{**data["node_groups"][0], "ray_placement": "strict_spread"}]
    assert _layout(parse_config(data, "spread")) == [([0, 1], "STRICT_SPREAD")]


def test_split_groups_sharing_ranks_must_agree():
    base = {"model": "llama", "backend": "ray", "device": "cpu"}
    groups = [{"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2, "ray_placement": "spread"},
              {"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["chat"],
               "ray_placement": "strict_pack"}]
    config = parse_config({**base, "node_groups": groups}, "two")
    with pytest.raises(ConfigError, match="different ray_placement"):
        pack_strategy(config, [0, 1])


@pytest.mark.parametrize(("end", "lost"), [
    ("ActorUnavailableError: The actor abc is unavailable: RpcError: Socket closed", True),
    ("RayTaskError(RuntimeError): out of memory", False),
])
def test_an_unreachable_actor_loses_its_node_and_a_crash_does_not(end: str, lost: bool):
    """Ray may report a rank's actor unreachable (its raylet is gone) before its heartbeats run
    out: that is the node lost, as silence is (its restart waits for the bundle to move); an
    actor that raised is a rank that died, on a node still good."""
    from types import SimpleNamespace

    from mstar.runtime.ray_workers import RayWorkers

    workers = object.__new__(RayWorkers)  # only the failure wording and the lost nodes: no cluster
    workers.lost_nodes = set()
    workers._where = lambda handle: f"Ray actor on node {handle.node[:8]}"
    process = SimpleNamespace(proc=SimpleNamespace(rank=0, node="0123456789abcdef", end=lambda: end))
    message = workers._gone(process)
    assert message.startswith("worker rank 0 (Ray actor on node 01234567)") and end in message
    assert ("was lost" in message) is lost and workers.lost_nodes == ({"0123456789abcdef"} if lost else set())
