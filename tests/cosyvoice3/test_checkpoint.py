"""The released ``llm.pt`` and ``flow.pt`` names at Fun-CosyVoice3-0.5B's geometry
(``fixtures/released_keys.json``, listed by ``record_reference.py`` from the official modules)
load into ours both ways: every released name fills a parameter or buffer (the LM's unused
text head aside) and every parameter and persistent buffer is filled, shapes checked. Built on
the meta device, so the 0.5B LM costs no memory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.cosyvoice3 import (
    CosyVoice3Flow,
    FlowConfig,
    SpeechLM,
    SpeechLMConfig,
    flow_name_map,
    llm_name_map,
    qwen2_config,
)
from mstar.model.cosyvoice3.checkpoint import LLM_SKIPPED, load_parts
from mstar.model.weights import WeightLoadError, load_weights
from tests.cosyvoice3.record_reference import text_embedding
from tests.cosyvoice3.test_flow import flow_config
from tests.model.test_hift_causal import CAUSAL, causal_generator
from tests.support.pages import Pages

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



def test_a_model_directory_loads_into_working_parts(reference, tmp_path: Path) -> None:
    """A tiny directory in the released layout (the recorded reference weights, a causal HiFT
    of ours saved under its released names): the LM gives the reference's first logits and the
    flow the reference's mel."""
    lm_case, flow_case = reference["lm"]["cosyvoice3"], reference["flow"]
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    (tmp_path / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(dict(lm_case["qwen2"], model_type="qwen2")))
    embed = text_embedding(lm_case["qwen2"]["vocab_size"], lm_case["qwen2"]["hidden_size"])
    torch.save({**lm_case["state"], "llm.model.model.embed_tokens.weight": embed, "llm.model.lm_head.weight": embed},
               tmp_path / "llm.pt")
    torch.save(flow_case["state"], tmp_path / "flow.pt")
    hift_config = replace(CAUSAL, in_channels=80)
    torch.save({f"generator.{k}": v for k, v in causal_generator(hift_config).state_dict().items()},
               tmp_path / "hift.pt")
    parts = load_parts(tmp_path, speech_token_size=lm_case["speech_token_size"],
                       flow=flow_config(flow_case), hift=hift_config)
    caches = allocate_kv_cache(*[parts.lm.cache_shape()[0], 16, 4, *parts.lm.cache_shape()[1:]], torch.float32,
                               torch.device("cpu"))
    with torch.no_grad():
        ids = parts.lm.prompt_ids(torch.cat([lm_case["prompt_text"], lm_case["text"]]), lm_case["prompt_speech"])
        logits = parts.lm.compute_logits(parts.lm(ids, Pages(16, 4).step([("a", ids.shape[0])]), caches)[-1])
        inputs = flow_case["inputs"]
        mel = parts.flow(inputs["token"], inputs["prompt_token"], inputs["prompt_feat"], inputs["embedding"])
    assert torch.allclose(logits, lm_case["logits"][0], rtol=0, atol=1e-5 * lm_case["logits"][0].abs().max())
    assert torch.allclose(mel, flow_case["whole"], rtol=0, atol=1e-5 * flow_case["whole"].abs().max())
    assert parts.hift.config.causal
    (tmp_path / "hift.pt").unlink()
    with pytest.raises(FileNotFoundError, match="hift.pt"):
        load_parts(tmp_path, speech_token_size=lm_case["speech_token_size"], flow=flow_config(flow_case),
                   hift=hift_config)
