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
