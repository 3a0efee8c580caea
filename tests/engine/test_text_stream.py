"""The emit path's detokeniser: decoding a short window per token must give exactly the
text a full decode of every id gives, for a byte-level BPE tokenizer (characters split
across tokens) and a SentencePiece-style one (a word's leading space dropped at the start
of a string), with stop strings cut where they appear."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from benchmarks.common import tiny_llama_dir
from mstar.model.llama.checkpoint import LlamaCheckpoint
from mstar.model.text_stream import TextStream

TEXT = "Héllo wörld: 日本語 and 🙂 emoji, naïve café!"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return LlamaCheckpoint.locate(str(tiny_llama_dir(tmp_path_factory.mktemp("tok"))), None).tokenizer()


@pytest.fixture(scope="module")
def metaspace():
    words = ["<unk>", "▁Hello", "▁world", "!", "▁how", "▁are", "▁you", "?", "▁"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def stream_text(tokenizer, ids: list[int], chunks: list[int], stop: list[str] | None = None) -> tuple[str, TextStream]:
    stream = TextStream(tokenizer, stop)
    text, i = "", 0
    for size in chunks:
        if i >= len(ids):
            break
        event = stream.feed("text", torch.tensor(ids[i:i + size]))
        i += size
        if event is not None:
            text += event.text
            assert "\ufffd" not in event.text or "\ufffd" in tokenizer.decode(ids, skip_special_tokens=True)
    tail = stream.finish("stop")
    return text + (tail.text if tail else ""), stream


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_byte_level_matches_full_decode(byte_level, chunk):
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # multi-byte characters come as several byte tokens
    text, stream = stream_text(byte_level, ids, [chunk] * len(ids))
    assert text == byte_level.decode(ids, skip_special_tokens=True) == TEXT
    assert stream.generated == len(ids)


def test_random_ids_match_full_decode(byte_level):
    rng = random.Random(0)
    special = set(byte_level.all_special_ids)
    pool = [i for i in range(len(byte_level)) if i not in special]
    for _ in range(20):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        ids += byte_level.encode("é", add_special_tokens=False)  # end on a complete character
        chunks = [rng.randint(1, 4) for _ in ids]
        text, _ = stream_text(byte_level, ids, chunks)
        assert text == byte_level.decode(ids, skip_special_tokens=True)


def test_leading_space_kept_in_context(metaspace):
    ids = metaspace.convert_tokens_to_ids(["▁Hello", "▁world", "!", "▁how", "▁are", "▁you", "?"])
    assert metaspace.decode(ids[1:2]) == "world"  # alone, the word loses its space
    text, _ = stream_text(metaspace, ids, [1] * len(ids))
    assert text == metaspace.decode(ids) == "Hello world! how are you?"


def test_wrapper_path_when_backend_would_differ(byte_level):
    """A tokenizer that cleans up spaces is decoded through its wrapper (same text)."""
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    byte_level.clean_up_tokenization_spaces = True
    try:
        stream = TextStream(byte_level)
        assert stream._backend is None
        text, _ = stream_text(byte_level, ids, [1] * len(ids))
    finally:
        byte_level.clean_up_tokenization_spaces = False
    assert text == byte_level.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", ["wörld", "日本", "🙂", "!"])
def test_stop_string_cuts_the_text(byte_level, stop):
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    text, stream = stream_text(byte_level, ids, [1] * len(ids), [stop])
    assert stream.stopped
    assert text == TEXT[: TEXT.index(stop)]
