"""Deployment YAML: parsing, and startup errors that name the key."""

import pytest

from mstar.config import ConfigError, load_config, parse_config
from mstar.runtime.launch import start


def test_defaults_and_yaml_file(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(
        "model: smollm2\nmax_seq_len: 512\nnode_groups:\n  - {node_names: [llm], ranks: [0], graph_walks: [chat]}\n"
        "resources:\n  kv_cache: {max_num_pages: 64, page_size: 8}\nmodel_kwargs: {seed: 3}\n"
    )
    config = load_config(path)
    assert config.model == "smollm2"
    assert config.max_seq_len == 512
    assert config.resources.kv_cache.page_size == 8
    assert config.node_groups[0].graph_walks == ["chat"]
    assert config.model_kwargs == {"seed": 3}
    assert config.num_ranks == 1
    assert load_config(path, {"max_seq_len": 128}).max_seq_len == 128


@pytest.mark.parametrize(
    "data, key",
    [
        ({"model": "smollm2", "max_seq_lenn": 5}, "max_seq_lenn"),
        ({"model": "smollm2", "max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"model": "smollm2", "prepare_threads": 0}, "prepare_threads"),
        ({"model": "smollm2", "resources": {"kv_cache": {"page_size": 0}}}, "resources.kv_cache.page_size"),
        ({"model": "smollm2", "resources": {"kv_cache": {"pages": 3}}}, "resources.kv_cache.pages"),
        ({"model": "smollm2", "node_groups": [{"node_names": [], "ranks": [0]}]}, "node_groups.0.node_names"),
        ({"model": "smollm2", "node_groups": [{"node_names": ["llm"], "ranks": [1]}]}, "ranks must be 0..N-1"),
        ({"model": "smollm2", "load_format": "pickle"}, "load_format"),
        ({"model": "orpheus", "stream_pacing": {"ahead": 1.0}}, "stream_pacing.ahead"),
        ({"model": "orpheus", "stream_pacing": {"ahead_s": 0}}, "stream_pacing.ahead_s"),
        ({"model": "orpheus", "stream_pacing": {"max_streams": 0}}, "stream_pacing.max_streams"),
        ({}, "model"),
    ],
)
def test_bad_config_names_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert key in str(err.value)


def test_unreadable_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"node_groups": [{"node_names": ["vae"], "ranks": [0]}]}, "node_groups[0].node_names: unknown node 'vae'"),
        ({"node_groups": [{"node_names": ["llm"], "ranks": [0], "graph_walks": ["paint"]}]},
         "node_groups[0].graph_walks: unknown walk 'paint'"),
        ({"node_groups": [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["llm"], "ranks": [0]}]},
         "placed twice"),
        ({"max_concurrent_requests": 64, "resources": {"kv_cache": {"max_num_pages": 8}}},
         "resources.kv_cache.max_num_pages"),
    ],
)
def test_startup_refuses_bad_placement_and_pools(overrides, key):
    # These fail before any weights load.
    with pytest.raises(ConfigError) as err:
        start(parse_config({"model": "smollm2", **overrides}), in_process=True)
    assert key in str(err.value)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        start(parse_config({"model": "nope"}), in_process=True)
