"""OmniVoice's prompt side against omnivoice 0.2.1: the conditional row (style, text with
non-verbal tags, reference codes, masked target) through the same character tokenizer, the
target length rule, text clean-up, transcript punctuation and language resolution."""

from __future__ import annotations

import pytest
import torch
from omnivoice_reference import reference

from mstar.model.omnivoice.prompt import (
    combine_text,
    end_with_punctuation,
    prompt_row,
    resolve_language,
    target_frames,
)
from tests.support.omnivoice import char_tokenizer

SAMPLES = ["Hello there, how are you?", "你好，世界。", "안녕하세요 여러분", "こんにちは、世界",
           "नमस्ते दुनिया", "مَرْحَبًا بِالْعَالَم", "Chào thế giới", "สวัสดีครับ", "Привет, мир! 123",
           "Hello 🌍! This is fun 🎉", "Ja [laughter] genau\tso  ist\nes", "（括号） 中 文 words",
           "Γειά σου κόσμε", "שלום עולם", "ሰላም ለዓለም", ""]


@pytest.fixture(scope="module")
def ref_module():
    return reference()


@pytest.fixture(scope="module")
def ref_model(ref_module):
    from transformers import PreTrainedTokenizerFast

    from mstar.model.omnivoice import tiny_config

    config = tiny_config()
    model = ref_module.OmniVoice(ref_module.OmniVoiceConfig(
        audio_vocab_size=config.audio_vocab_size, audio_mask_id=config.audio_mask_id,
        num_audio_codebook=config.num_audio_codebook, llm_config=config.llm.to_hf_dict()))
    model.text_tokenizer = PreTrainedTokenizerFast(tokenizer_object=char_tokenizer())
    from omnivoice.utils.duration import RuleDurationEstimator

    model.duration_estimator = RuleDurationEstimator()
    return model


@pytest.mark.parametrize("cloning", [True, False])
@pytest.mark.parametrize("text", ["Hi [laughter] there [sigh]", "你好 世界", "[surprise-oh]"])
def test_prompt_row_matches(ref_model, text, cloning):
    codes = torch.randint(0, 1024, (4, 5)) if cloning else None
    ref_text = "the reference words" if cloning else None
    expected = ref_model._prepare_inference_inputs(text, 7, ref_text, codes, "en" if cloning else None, None)
    row, audio_start = prompt_row(char_tokenizer(), 4, 1024, text, 7, language="en" if cloning else None,
                                  ref_text=ref_text, ref_codes=codes)
    assert torch.equal(row, expected["input_ids"][0])
    assert torch.equal(torch.arange(row.shape[1]) >= audio_start, expected["audio_mask"][0])


@pytest.mark.parametrize("speed", [1.0, 1.3])
def test_target_frames_match(ref_model, speed):
    for text in SAMPLES:
        for ref_text, frames in (("A short reference.", 40), (None, None), ("参考文本", 60), ("x" * 300, 250)):
            expected = ref_model._estimate_target_tokens(text, ref_text, frames, speed=speed)
            assert target_frames(text, ref_text, frames, speed) == expected, (text, ref_text)


def test_text_clean_up_matches(ref_module):
    from omnivoice.utils.text import add_punctuation

    for text in SAMPLES:
        assert combine_text(text) == ref_module._combine_text(text)
        assert combine_text(text, " ref  text ") == ref_module._combine_text(text, ref_text=" ref  text ")
        assert end_with_punctuation(text) == add_punctuation(text)
    assert end_with_punctuation("no mark") == "no mark."
    assert end_with_punctuation("没有") == "没有。"


def test_languages_resolve_by_name_or_id(ref_module, caplog):
    for value in ("en", "English", "ENGLISH", "Vietnamese", "vi", "zh", "Chinese", "yue", "none", None, "Klingon",
                  "xx", "Aja (Benin)"):
        assert resolve_language(value) == ref_module._resolve_language(value), value
    assert resolve_language("Vietnamese") == "vi"
    with caplog.at_level("WARNING"):
        assert resolve_language("Klingon") is None
    assert "Klingon" in caplog.text
