"""Placement validation at startup: ranks that do not exist, a node placed twice for a walk,
tp_size x sp_size that does not match the ranks or does not divide the model's heads, a
follower of a split group given other work; each error names the config key. A valid split
group is led by its first rank."""

from __future__ import annotations

import json

import pytest

from mstar.config import ConfigError, parse_config
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.model import LlamaChat
from mstar.runtime.launch import start
from mstar.runtime.placement import (
    NodeGroup,
    Placement,
    _check_followers,
    build_placement,
)


@pytest.fixture
def llama_dir(tmp_path):
    """A Llama checkpoint folder holding only its config (4 heads, 2 KV heads, MLP 96)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return str(tmp_path)


def placement_error(llama_dir: str, *groups: dict) -> str:
    config = parse_config({"model": "llama", "model_path": llama_dir, "node_groups": list(groups)})
    spec = LlamaChat(config)
    with pytest.raises(ValueError) as err:
        build_placement(spec.graph(), config, spec)
    return str(err.value)


def config_error(**data) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config({"model": "llama", **data})
    return str(err.value)


def test_llama_declares_what_tensor_parallelism_splits(llama_dir):
    dims = LlamaChat(parse_config({"model": "llama", "model_path": llama_dir})).parallel_dims()
    assert dims["llm"].tensor == {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
    assert dims["llm"].problems(2, 1) == []
    assert dims["llm"].problems(4, 1) == ["tp_size 4 does not divide num_key_value_heads (2)"]


@pytest.mark.parametrize("groups, message", [
    ([{"node_names": ["llm"], "ranks": [0, 0], "tp_size": 2}], "node_groups[0].ranks: rank 0 is listed twice"),
    ([{"node_names": ["llm"], "ranks": [0], "tp_size": 2}],
     "node_groups[0].tp_size: tp_size (2) x sp_size (1) needs 2 ranks, node_groups[0].ranks lists 1"),
    ([{"node_names": ["llm"], "ranks": [0, 1, 2], "tp_size": 2, "sp_size": 2}],
     "node_groups[0].tp_size: tp_size (2) x sp_size (2) needs 4 ranks"),
    ([{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["llm"], "ranks": [2]}],
     "ranks must be 0..N-1 with none skipped"),
])
def test_config_refuses_rank_lists_that_cannot_be(groups, message):
    assert message in config_error(node_groups=groups)


def test_a_rank_without_a_device_does_not_exist():
    groups = [{"node_names": ["llm"], "ranks": [0], "graph_walks": ["chat"]},
              {"node_names": ["llm"], "ranks": [1], "graph_walks": ["other"]}]
    message = config_error(device="cuda", gpus=[3], node_groups=groups)
    assert "node_groups[1].ranks: rank 1 does not exist: gpus lists 1 device(s)" in message


@pytest.mark.parametrize("groups, message", [
    ([{"node_names": ["llm"], "ranks": [0], "graph_walks": ["chat"]},
      {"node_names": ["llm"], "ranks": [1], "graph_walks": ["chat"]}],
     "node_groups[1].node_names: node 'llm' is placed twice for walk 'chat' (also by node_groups[0])"),
    ([{"node_names": ["llm", "llm"], "ranks": [0]}], "node_groups[0].node_names: node 'llm' is listed twice"),
    ([{"node_names": ["llm"], "ranks": [0, 1, 2, 3], "tp_size": 4}],
     "node_groups[0].tp_size: node 'llm': tp_size 4 does not divide num_key_value_heads (2)"),
    ([{"node_names": ["llm"], "ranks": [0, 1, 2], "tp_size": 3}],
     "node_groups[0].tp_size: node 'llm': tp_size 3 does not divide num_attention_heads (4); "
     "tp_size 3 does not divide num_key_value_heads (2)"),
    ([{"node_names": ["llm"], "ranks": [0, 1], "sp_size": 2}],
     "node_groups[0].sp_size: node 'llm': the node does not support sequence parallelism"),
])
def test_placement_errors_name_the_key(llama_dir, groups, message):
    assert message in placement_error(llama_dir, *groups)


def test_a_valid_split_is_led_by_its_first_rank(llama_dir):
    config = parse_config({"model": "llama", "model_path": llama_dir,
                           "node_groups": [{"node_names": ["llm"], "ranks": [1, 0], "tp_size": 2}]})
    spec = LlamaChat(config)
    placement = build_placement(spec.graph(), config, spec)
    assert placement.rank_of("chat", "llm") == 1 and placement.ranks == [1]
    assert placement.followers() == {0}
    assert [g.layout for g in placement.split_groups()] == [((1, 0), 2, 1)]


def test_a_follower_runs_nothing_but_its_leaders_groups():
    split = NodeGroup(("llm",), (0, 1), ("chat",), tp_size=2)
    alone = NodeGroup(("llm",), (1,), ("other",))
    with pytest.raises(ValueError, match=r"node_groups\[1\].ranks: rank 1 follows rank 0 in the split group "
                                         r"node_groups\[0\], so it cannot run other nodes"):
        _check_followers([split, alone])
    _check_followers([split, NodeGroup(("codec",), (0,))])  # its leader may run other nodes


def test_a_follower_follows_one_leader(llama_dir):
    graph = LlamaChat(parse_config({"model": "llama"})).graph()
    led_by_0 = NodeGroup(("llm",), (0, 1), ("chat",), tp_size=2)
    led_by_1 = NodeGroup(("llm",), (1, 2), ("other",), tp_size=2)
    with pytest.raises(ValueError, match=r"node_groups\[1\].ranks: rank 1 follows rank 0"):
        _check_followers([led_by_0, led_by_1])
    same_leader = NodeGroup(("llm",), (0, 1), ("other",), tp_size=2)
    _check_followers([led_by_0, same_leader])  # one engine serves both walks
    split_differently = NodeGroup(("llm",), (0, 1), ("other",), sp_size=2)
    with pytest.raises(ValueError, match=r"node_groups\[1\].ranks: node 'llm' already runs on rank 0 split "
                                         r"differently \(node_groups\[0\]\)"):
        _check_followers([led_by_0, split_differently])
    assert Placement(graph, (led_by_0,)).followers() == {1}


class Unsplittable(LlamaChat):
    """A family that declares nothing it could split (the ModelSpec default)."""

    def parallel_dims(self):
        return {}


def test_a_node_that_declares_no_dims_cannot_be_split(llama_dir):
    config = parse_config({"model": "llama", "model_path": llama_dir,
                           "node_groups": [{"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2}]})
    spec = Unsplittable(config)
    with pytest.raises(ValueError, match=r"node_groups\[0\].tp_size: node 'llm' cannot be split"):
        build_placement(spec.graph(), config, spec)


def test_startup_names_the_key_before_loading_weights(llama_dir):
    config = parse_config({"model": "llama", "model_path": llama_dir,
                           "node_groups": [{"node_names": ["llm"], "ranks": [0, 1, 2, 3], "tp_size": 4}]})
    with pytest.raises(ConfigError, match=r"node_groups\[0\].tp_size: node 'llm': tp_size 4 does not divide"):
        start(config, in_process=True)


def test_groups_are_led_by_their_first_rank(llama_dir):
    config = parse_config({"model": "llama", "node_groups": [{"node_names": ["llm"], "ranks": [0]}]})
    placement = build_placement(LlamaChat(config).graph(), config)
    assert placement.rank_of("chat", "llm") == 0
    assert placement.group_of("chat", "llm").leader == 0 and placement.group_of("chat", "llm").tp_size == 1


def test_split_groups_and_their_members(llama_dir):
    # What the workers read: which ranks run a split group, and who gets its plans.
    graph = LlamaChat(parse_config({"model": "llama"})).graph()
    split = NodeGroup(("llm",), (1, 2), ("chat",), tp_size=2)
    placement = Placement(graph, (split,))
    assert placement.rank_of("chat", "llm") == 1  # plans go to the leader
    assert placement.nodes_on(1) == {"llm"} and placement.nodes_on(2) == set()
    assert placement.groups_on(2) == {split: {"llm"}} and placement.groups_on(0) == {}
    assert placement.split_groups() == [split]


def test_the_tp2_example_config_places_one_split_group():
    from pathlib import Path

    from mstar.config import load_config

    config = load_config(Path(__file__).parents[2] / "configs" / "llama_tp2.yaml")
    assert (config.device, config.gpus, config.num_ranks) == ("cuda", [0, 1], 2)
    placement = build_placement(LlamaChat(config).graph(), config)  # the weights' head counts: not read here
    (group,) = placement.split_groups()
    assert group.layout == ((0, 1), 2, 1) and group.node_names == ("llm",)
    assert placement.rank_of("chat", "llm") == 0 and placement.followers() == {1}
