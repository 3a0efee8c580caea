"""Qwen3-ASR's front and back ends against the reference: the log-mels against transformers'
``Qwen3ASRFeatureExtractor``, the repetition collapse against transformers' copy of the SDK's
(on loops, near-loops and random text), the language parse (detected, forced, none), the
language names, and the prompt (one pad per audio row, the forced language after it)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mstar.contract import RequestError
from mstar.model.qwen3_asr.text import collapse_repetitions, language_code, language_name, parse_output


def test_log_mels_match_the_feature_extractor() -> None:
    from transformers import Qwen3ASRFeatureExtractor

    from mstar.model.whisper.features import log_mel_spectrogram

    gen = np.random.default_rng(0)
    for n in (16000, 23457):
        wave = (0.1 * gen.standard_normal(n)).astype(np.float32)
        ref = Qwen3ASRFeatureExtractor()(wave, sampling_rate=16000, return_tensors="pt", padding=True,
                                          return_attention_mask=True)  # as the processor calls it
        frames = int(ref["attention_mask"].sum())
        ours = log_mel_spectrogram(torch.from_numpy(wave), 128, n_samples=n)
        assert ours.shape == (128, frames)
        err = ((ours - ref["input_features"][0, :, :frames]).abs().max() / ours.abs().max()).item()
        assert err <= 1e-5, err


def test_repetition_collapse_matches_the_reference() -> None:
    from transformers.models.qwen3_asr.processing_qwen3_asr import _detect_and_fix_repetitions

    rng = random.Random(0)
    cases = ["a" * 25 + "b", "ha" * 30 + " end", "x" * 20, "abc" * 19 + "ab", "the cat " * 21 + "sat",
             "no loop here at all", "", "ab" * 10 + "ab" * 10 + "c" + "de" * 25]
    cases += ["".join(rng.choice("ab ") for _ in range(rng.randint(0, 200))) for _ in range(200)]
    cases += ["".join(rng.choice("abc") * rng.randint(1, 30) for _ in range(8)) for _ in range(100)]
    for text in cases:
        assert collapse_repetitions(text) == _detect_and_fix_repetitions(text), text
    assert collapse_repetitions("ha" * 30 + " end") == "ha end"


def test_language_is_parsed_detected_forced_or_none() -> None:
    assert parse_output("language English<asr_text> hello there", None) == ("English", "hello there")
    assert parse_output("language None<asr_text>", None) == ("", "")
    assert parse_output("hello", None) == ("", "hello")
    assert parse_output("hallo welt", "German") == ("German", "hallo welt")
    assert parse_output("language english<asr_text>" + "la" * 40, None) == ("English", "la")
    assert language_code("English") == "en" and language_code("Klingon") == ""


def test_language_names_and_refusal() -> None:
    assert language_name("de") == "German" and language_name("CANTONESE") == "Cantonese"
    assert language_name("yue") == "Cantonese"
    with pytest.raises(RequestError, match="language"):
        language_name("tlh")
