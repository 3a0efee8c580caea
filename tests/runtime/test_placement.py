"""Placement validation at startup: ranks that do not exist, a node placed twice for a walk,
tp_size x sp_size that does not match the ranks or does not divide the model's heads; each
error names the config key. A valid split group is refused (not wired in the runtime yet)."""

from __future__ import annotations

import json

import pytest

from mstar.config import ConfigError, parse_config
from mstar.model.llama.config import LlamaConfig
from mstar.model.llama.model import LlamaChat
from mstar.runtime.launch import start
from mstar.runtime.placement import NodeGroup, Placement, build_placement


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


def test_a_valid_split_is_refused_until_the_runtime_runs_it(llama_dir):
    message = placement_error(llama_dir, {"node_names": ["llm"], "ranks": [0, 1], "tp_size": 2})
    assert message.startswith("node_groups[0].tp_size: the runtime cannot run one node group over several")


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
    # What the runtime will read once it runs split groups (build_placement refuses them now).
    graph = LlamaChat(parse_config({"model": "llama"})).graph()
    split = NodeGroup(("llm",), (1, 2), ("chat",), tp_size=2)
    placement = Placement(graph, (split,))
    assert placement.rank_of("chat", "llm") == 1  # plans go to the leader
    assert placement.nodes_on(1) == {"llm"} and placement.nodes_on(2) == set()
    assert placement.groups_on(2) == {split: {"llm"}} and placement.groups_on(0) == {}
    assert placement.split_groups() == [split]
