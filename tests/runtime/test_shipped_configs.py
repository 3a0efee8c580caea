"""Every YAML under configs/ parses and places: each walk's every node lands on a rank.

A family that grows a node (Cosmos3's ``sound``) must place it in each shipped config, or
the server refuses to start with that config. The configs name GPUs this machine does not
have, so the CUDA device count is stood in for; nothing here loads weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar.config import load_config
from mstar.model.registry import model_class
from mstar.runtime.placement import build_placement

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs_to_check() -> None:
    assert len(CONFIGS) > 50


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_shipped_config_places_every_node_of_every_walk(path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # the configs' GPUs, not this machine's
    config = load_config(path)
    graph = model_class(config.model)(config).graph()
    placement = build_placement(graph, config)
    for walk in graph.walks.values():
        for step in walk.steps():
            assert placement.rank_of(walk.name, step.node) in range(config.num_ranks), (walk.name, step.node)
