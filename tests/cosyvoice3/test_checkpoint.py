"""The released ``llm.pt`` and ``flow.pt`` names at Fun-CosyVoice3-0.5B's geometry
(``fixtures/released_keys.json``, listed by ``record_reference.py`` from the official modules)
load into ours both ways: every released name fills a parameter or buffer (the LM's unused
text head aside) and every parameter and persistent buffer is filled, shapes checked. Built on
the meta device, so the 0.5B LM costs no memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.model.cosyvoice3 import (
    CosyVoice3Flow,
    FlowConfig,
    SpeechLM,
    SpeechLMConfig,
    flow_name_map,
    llm_name_map,
    qwen2_config,
)
from mstar.model.cosyvoice3.checkpoint import LLM_SKIPPED
from mstar.model.weights import WeightLoadError, load_weights

KEYS = json.loads((Path(__file__).parent / "fixtures" / "released_keys.json").read_text())


def meta_tensors(shapes: dict[str, list[int]]):
    return ((name, torch.empty(shape, device="meta")) for name, shape in shapes.items())


def test_llm_pt_layout_loads_both_ways() -> None:
    with torch.device("meta"):
        model = SpeechLM(SpeechLMConfig(backbone=qwen2_config(KEYS["qwen2"])))
    assert LLM_SKIPPED <= KEYS["llm"].keys()
    load_weights(model, meta_tensors(KEYS["llm"]), name_map=llm_name_map)
    assert model.llm_decoder.bias is None and model.speech_embedding.weight.shape == (6761, 896)


def test_flow_pt_layout_loads_both_ways() -> None:
    with torch.device("meta"):
        model = CosyVoice3Flow(FlowConfig())
    load_weights(model, meta_tensors(KEYS["flow"]), name_map=flow_name_map)
    assert len(model.estimator.blocks) == 22


def test_a_wrong_shape_or_a_stray_name_is_refused() -> None:
    with torch.device("meta"):
        model = CosyVoice3Flow(FlowConfig())
    shapes = dict(KEYS["flow"])
    shapes["decoder.estimator.proj_out.weight"] = [81, 1024]
    with pytest.raises((WeightLoadError, ValueError, RuntimeError)):
        load_weights(model, meta_tensors(shapes), name_map=flow_name_map)
    shapes = dict(KEYS["flow"], **{"decoder.estimator.long_skip_connection.weight": [1024, 2048]})
    with pytest.raises(WeightLoadError, match="long_skip_connection"):
        load_weights(model, meta_tensors(shapes), name_map=flow_name_map)
