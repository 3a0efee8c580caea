"""Loading a Qwen3-Omni thinker (text decoder, audio and vision encoders) from a directory in the
released key layout (``thinker.model.…``, ``thinker.audio_tower.…``, ``thinker.visual.…``,
``thinker.lm_head``, experts stored apart), with coverage both ways; the parts not built yet
(talker, code2wav) are skipped by prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers.models.qwen3_omni_moe")

from mstar.model.qwen3_omni.checkpoint import (  # noqa: E402
    Qwen3OmniThinker,
    load_thinker,
    load_thinker_dir,
    load_visual,
)
from mstar.model.qwen3_omni.vision import Qwen3OmniVisionConfig, Qwen3OmniVisionEncoder  # noqa: E402
from mstar.model.weights import WeightLoadError  # noqa: E402
from tests.support.qwen3_omni import reference_thinker, released_keys  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return reference_thinker(seed=7)


def test_directory_round_trip(reference, tmp_path: Path) -> None:
    keys = dict(released_keys(reference))
    keys["talker.model.norm.weight"] = torch.ones(4)  # another component: skipped
    keys = {n: t.contiguous() for n, t in keys.items()}
    half = len(keys) // 2
    names = sorted(keys)
    save_file({n: keys[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: keys[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe",
                                                      "thinker_config": reference.config.to_dict()}))
    thinker = load_thinker_dir(tmp_path)
    ours, theirs = thinker.text.model.layers[0].mlp.experts, reference.model.language_model.layers[0].mlp.experts
    torch.testing.assert_close(ours.gate_up.weight, theirs.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.down.weight, theirs.down_proj, rtol=0, atol=0)
    torch.testing.assert_close(thinker.audio_tower.conv_out.weight, reference.model.audio_tower.conv_out.weight,
                               rtol=0, atol=0)
    torch.testing.assert_close(thinker.text.lm_head.weight, reference.lm_head.weight, rtol=0, atol=0)
    ours, theirs = thinker.visual.state_dict(), reference.model.visual.state_dict()
    assert sorted(ours) == sorted(theirs)  # merger_list.0.ln_q …: the released names
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0)


def test_coverage_both_ways(reference) -> None:
    config = {"thinker_config": reference.config.to_dict()}
    keys = released_keys(reference)
    without = [(n, t) for n, t in keys if n != "thinker.audio_tower.layers.1.fc2.bias"]
    with pytest.raises(WeightLoadError, match=r"audio_tower\.layers\.1\.fc2\.bias"):
        load_thinker(Qwen3OmniThinker.from_hf_dict(config), without)
    stray = keys + [("thinker.model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))]
    with pytest.raises(WeightLoadError, match=r"experts\.8\.up_proj"):
        load_thinker(Qwen3OmniThinker.from_hf_dict(config), stray)
    unknown = keys + [("thinker.speaker_embed.weight", torch.zeros(2))]
    with pytest.raises(WeightLoadError, match="speaker_embed"):
        load_thinker(Qwen3OmniThinker.from_hf_dict(config), unknown)


def test_visual_coverage_both_ways(reference) -> None:
    config = {"thinker_config": reference.config.to_dict()}
    keys = released_keys(reference)
    without = [(n, t) for n, t in keys if n != "thinker.visual.merger_list.0.ln_q.bias"]
    with pytest.raises(WeightLoadError, match=r"merger_list\.0\.ln_q\.bias"):
        load_thinker(Qwen3OmniThinker.from_hf_dict(config), without)
    stray = keys + [("thinker.visual.merger_list.1.ln_q.weight", torch.ones(128))]  # one deepstack tap only
    with pytest.raises(WeightLoadError, match=r"merger_list\.1\.ln_q"):
        load_thinker(Qwen3OmniThinker.from_hf_dict(config), stray)
    tower = Qwen3OmniVisionEncoder(Qwen3OmniVisionConfig.from_hf_dict(config))
    with pytest.raises(WeightLoadError, match=r"blocks\.0\.attn\.qkv\.weight"):
        load_visual(tower, [(n, t) for n, t in keys if n != "thinker.visual.blocks.0.attn.qkv.weight"])
    load_visual(tower, keys)  # the other parts' keys are skipped
