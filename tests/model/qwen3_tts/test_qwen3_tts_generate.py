"""The talker prompt and the greedy talker loop against the reference's whole ``generate``
(``fixtures/generate.safetensors``, recorded by ``record_reference.py``): a built-in speaker
with a language, a dialect speaker under ``auto``, a voice-design instruction, and the
non-streaming text layout; every frame's codes equal."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mstar.model.qwen3_tts.checkpoint import load_talker
from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.qwen3_tts.prompt import language_id, languages, talker_prompt
from mstar.model.qwen3_tts.speech import run_talker, suppressed_codes
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker
from tests.model.qwen3_tts.test_qwen3_tts_parity import FIXTURES


@pytest.fixture(scope="module")
def recorded():
    with safe_open(FIXTURES / "generate.safetensors", framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = Qwen3TTSConfig.from_hf_dict(json.loads(meta["config"]))
    talker = Qwen3TTSTalker(config.talker).eval()
    load_talker(talker, [(k, v.float()) for k, v in tensors.items() if not k.startswith("fx.")])
    fx = {k[3:]: v for k, v in tensors.items() if k.startswith("fx.")}
    return config, talker, fx, json.loads(meta["cases"])


@pytest.mark.parametrize("case", ["speaker", "dialect", "design", "non_streaming"])
def test_frames_match_reference_generate(recorded, case: str) -> None:
    config, talker, fx, cases = recorded
    kwargs = cases[case]
    instruct = fx.get(f"{case}.instruct_ids")
    prompt = talker_prompt(talker, config, fx[f"{case}.input_ids"].tolist(), language=kwargs["languages"][0],
                           speaker=kwargs["speakers"][0], non_streaming=kwargs.get("non_streaming_mode", False),
                           instruct_ids=None if instruct is None else instruct.tolist())
    # the reference's last drawn code (its 8th) gets no frame: max_new_tokens=8 made 7 frames
    codes = run_talker(talker, prompt, max_frames=7)
    assert torch.equal(codes.T, fx[f"{case}.codes"]), case


@pytest.mark.parametrize("case", ["x_vector", "icl", "icl_long_text", "icl_non_streaming"])
def test_clone_frames_match_reference_generate(recorded, case: str) -> None:
    """A clip's x-vector as the speaker row; in context, its transcript and frames too (text rows
    fewer and more than the clip's frame rows, and the non-streaming layout)."""
    config, talker, fx, cases = recorded
    kwargs = cases[case]
    reference = (fx["ref_ids"][3:-2].tolist(), fx["ref_code"]) if kwargs["icl"] else None
    prompt = talker_prompt(talker, config, fx[f"{case}.input_ids"].tolist(), speaker_embed=fx["x_vector"],
                           non_streaming=kwargs["non_streaming_mode"], reference=reference)
    codes = run_talker(talker, prompt, max_frames=len(fx[f"{case}.codes"]))
    assert torch.equal(codes.T, fx[f"{case}.codes"]), case


def test_language_and_speaker_names(recorded) -> None:
    config, talker, fx, _ = recorded
    assert languages(config) == ["auto", "chinese", "english"]
    assert language_id(config, "English", "vivian") == 1052 and language_id(config, "auto", "vivian") is None
    assert language_id(config, "auto", "dylan") == 1054 and language_id(config, "english", "dylan") == 1052
    with pytest.raises(KeyError, match="auto or one of chinese, english"):
        language_id(config, "klingon", None)
    with pytest.raises(KeyError, match="dylan, vivian"):
        talker_prompt(talker, config, fx["speaker.input_ids"].tolist(), speaker="nobody")
    assert suppressed_codes(talker) == [i for i in range(64, 1088) if i != 1060]
