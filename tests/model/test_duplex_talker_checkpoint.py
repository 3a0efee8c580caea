"""The duplex talker's weights from a VoiceChat checkpoint folder: the tiny EarTTS fixture's
tensors under the released names (``tts_model.*``, beside input-side ``stt_model.*`` tensors
the talker does not read) load into the same model the eartts port builds, coverage checked
both ways; the text table is padded to the LLM's vocabulary."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mstar.model.eartts.config import EarTTSConfig
from mstar.model.nemotron_duplex.talker import checkpoint_talker
from mstar.model.weights import WeightLoadError
from tests.model.eartts.eartts_fixture import built, reference


@pytest.fixture(scope="module")
def ref():
    return reference()


def _folder(tmp_path, state: dict[str, torch.Tensor]):
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_the_talker_loads_from_the_voicechat_layout(ref, tmp_path):
    state = dict(ref["state"]) | {"stt_model.llm.embed.weight": torch.zeros(4, 4)}
    config = EarTTSConfig.from_speech_generation(ref["config"])
    vocab = {f"t{i}": i for i in range(19)}
    model = checkpoint_talker(config, _folder(tmp_path, state), vocab, text_vocab=24)
    expected = built(ref)
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert model.speakers.keys() == expected.speakers.keys() == {"tiny"}
    assert torch.equal(model.speakers["tiny"], expected.speakers["tiny"])
    assert torch.equal(model.silence_codes, expected.silence_codes)
    # no text encoder in the tiny fixture: the table keeps its zeros, padded to the LLM's 24 ids
    assert model.talker.text.on.shape == model.talker.text.off.shape == (24, config.talker.hidden_size)


def test_coverage_is_checked_both_ways(ref, tmp_path):
    config = EarTTSConfig.from_speech_generation(ref["config"])
    vocab = {"a": 0}
    extra = dict(ref["state"]) | {"tts_model.tts_model.stray.weight": torch.zeros(2)}
    with pytest.raises(WeightLoadError, match="stray"):
        checkpoint_talker(config, _folder(tmp_path, extra), vocab)
    missing = {k: v for k, v in ref["state"].items() if not k.startswith("tts_model.audio_codec.decoder.")}
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="codec"):
        checkpoint_talker(config, _folder(tmp_path, missing), vocab)
