"""The T3 tokenizers against the reference's ids (``fixtures/tokenizers.json``).

``record_reference.py`` trained tiny tokenizer files in the released styles (grapheme BPE with
``[START]``/``[STOP]``/``[SPACE]``, the multilingual one with language tokens, a GPT-2 style
byte-level BPE for Turbo) and encoded a few sentences with the reference's ``EnTokenizer``,
``MTLTokenizer`` (language token, lower-casing, NFKD, Korean jamo) and Turbo's
``AutoTokenizer``. Japanese, Hebrew, Russian and Chinese need optional packages or the
checkpoint's Cangjie table and are left out here (Cangjie coding is checked on its own).
"""

from __future__ import annotations

import json

import pytest

from mstar.model.chatterbox.text import (
    CangjieTable,
    GraphemeTokenizer,
    MultilingualTokenizer,
    TurboTokenizer,
    hangul_to_jamo,
    normalize_punctuation,
    t3_text_ids,
)
from tests.chatterbox.tiny import FIXTURES, tiny_config

RECORD = json.loads((FIXTURES / "tokenizers.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    for name, content in RECORD["files"].items():
        (root / name).mkdir()
        (root / name / "tokenizer.json").write_text(json.dumps(content), encoding="utf-8")
    return root


def test_english_ids(files):
    tok = GraphemeTokenizer(files / "en" / "tokenizer.json")
    for text, ids in RECORD["en"]:
        assert tok.encode(text) == ids, text


def test_multilingual_ids(files):
    tok = MultilingualTokenizer(files / "mtl" / "tokenizer.json")
    assert len(RECORD["mtl"]) >= 5
    for language, text, ids in RECORD["mtl"]:
        assert tok.encode(text, language) == ids, (language, text)


def test_multilingual_refuses_an_unknown_language(files):
    with pytest.raises(ValueError, match="xx"):
        MultilingualTokenizer(files / "mtl" / "tokenizer.json").encode("hi", "xx")


def test_turbo_ids(files):
    tok = TurboTokenizer(files / "turbo")
    for text, ids in RECORD["turbo"]:
        assert tok.encode(text) == ids, text


def test_hangul_to_jamo():
    assert hangul_to_jamo("한 a") == "\u1112\u1161\u11ab a"


def test_cangjie_codes_index_shared_codes(monkeypatch):
    table = CangjieTable(["日\ta", "曰\ta", "月\tb\textra"])
    table.segmenter = None
    assert table("日曰月x") == "[cj_a][cj_.][cj_a][cj_1][cj_.][cj_b][cj_.]x"


@pytest.mark.parametrize("variant, text, expected", [
    ("english", "hello   world... yes; no", "Hello world,  yes,  no."),  # values printed by the reference
    ("turbo", "hello... yes; no", "Hello... yes; no."),
    ("multilingual", "你好。", "你好。"),
    ("english", "你好。", "你好。."),
    ("english", "", "You need to add some text for me to talk."),
])
def test_punctuation_like_the_reference(variant, text, expected):
    assert normalize_punctuation(text, variant) == expected


def test_text_ids_carry_start_and_stop_on_guided_variants():
    english, turbo = tiny_config("english"), tiny_config("turbo")
    assert t3_text_ids([5, 6], english) == [38, 5, 6, 0]
    assert t3_text_ids([5, 6], turbo) == [5, 6]
    assert len(t3_text_ids(list(range(30)), english)) == 32  # max_text_tokens 30 + the two markers
    with pytest.raises(ValueError, match="at most 32"):
        t3_text_ids(list(range(31)), english)


def test_text_front_reads_the_released_file_names(tmp_path):
    """The tokenizer files under their released names in a checkpoint directory; the ids the
    reference's generate would pass to T3 for the same text."""
    from mstar.model.chatterbox.t3_checkpoint import TEXT_FILES, T3TextFront

    files = RECORD["files"]
    (tmp_path / TEXT_FILES["english"]).write_text(json.dumps(files["en"]), encoding="utf-8")
    (tmp_path / TEXT_FILES["multilingual"]).write_text(json.dumps(files["mtl"]), encoding="utf-8")
    english = T3TextFront(tmp_path, tiny_config("english"))
    text, ids = RECORD["en"][0]  # "Hello world." needs no tidying
    assert english.ids(text) == [38, *ids, 0]
    multilingual = T3TextFront(tmp_path, tiny_config("multilingual"))
    language, text, ids = RECORD["mtl"][1]
    assert multilingual.ids(text, language) == [38, *ids, 0]
    turbo_dir = tmp_path / "turbo"
    turbo_dir.mkdir()
    (turbo_dir / "tokenizer.json").write_text(json.dumps(files["turbo"]), encoding="utf-8")
    text, ids = RECORD["turbo"][0]
    assert T3TextFront(turbo_dir, tiny_config("turbo")).ids(text) == ids
