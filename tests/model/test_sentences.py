"""The shared sentence chunker: pieces end at sentence ends, the first is short, none is over
the limit (by characters or by a token count), and ``enabled=False`` cuts only where the
limit forces it."""

from __future__ import annotations

import pytest

from mstar.model.sentences import SentenceChunker, split_sentences

STORY = ("The cat sat on the mat. It was warm! Was it asleep? Nobody knew; the dog did not care. "
         "Then the rain came, and everyone went inside.")


def test_sentences_end_at_marks_cjk_stops_and_line_breaks():
    assert split_sentences("One. Two!  Three?\nFour; five: six… seven") == [
        "One.", "Two!", "Three?", "Four;", "five:", "six…", "seven"]
    assert split_sentences("你好。今天天气很好！我们走吧") == ["你好。", "今天天气很好！", "我们走吧"]
    assert split_sentences("3.14 is pi. e.g.this") == ["3.14 is pi.", "e.g.this"]  # no space, no end


def test_first_piece_short_then_packed_to_the_target():
    pieces = SentenceChunker(limit=200, target=60, first_target=25).split(STORY)
    assert pieces[0] == "The cat sat on the mat."
    assert pieces == ["The cat sat on the mat.", "It was warm! Was it asleep? Nobody knew;",
                      "the dog did not care.", "Then the rain came, and everyone went inside."]
    assert " ".join(pieces) == STORY
    assert all(len(p) <= 60 for p in pieces[1:])


def test_a_sentence_over_its_target_is_a_piece_of_its_own():
    pieces = SentenceChunker(limit=200, target=10, first_target=10).split("Tiny. A much longer sentence here. Ok.")
    assert pieces == ["Tiny.", "A much longer sentence here.", "Ok."]


def test_a_sentence_over_the_limit_is_cut_at_its_last_space_that_fits():
    words = " ".join(["abcd"] * 30)
    pieces = SentenceChunker(limit=40).split(words)
    assert all(len(p) <= 40 for p in pieces) and " ".join(pieces) == words
    assert pieces[0] == " ".join(["abcd"] * 8)  # 39 characters: a ninth word would make 44


def test_a_word_over_the_limit_is_cut_anywhere():
    assert SentenceChunker(limit=4).split("abcdefghij") == ["abcd", "efgh", "ij"]


def test_long_cjk_sentences_are_cut_after_a_comma():
    text = "我们今天去公园，" * 5 + "然后回家。"
    pieces = SentenceChunker(limit=20).split(text)
    assert all(len(p) <= 20 for p in pieces)
    assert all(p.endswith("，") for p in pieces[:-1]) and "".join(pieces) == text
    assert SentenceChunker(limit=100).split("你好。今天很好。") == ["你好。今天很好。"]  # CJK joins with no space


def test_a_token_measure_bounds_pieces_by_tokens():
    tokens = lambda s: len(s.split())  # noqa: E731 - a stand-in tokenizer: one token a word
    chunker = SentenceChunker(limit=6, target=6, first_target=3, measure=tokens)
    pieces = chunker.split("one two three. four five. six seven eight nine ten eleven twelve thirteen.")
    assert pieces == ["one two three.", "four five.", "six seven eight nine ten eleven", "twelve thirteen."]
    assert all(tokens(p) <= 6 for p in pieces)


def test_chunking_off_cuts_only_where_the_limit_forces_it():
    chunker = SentenceChunker(limit=200, target=30, first_target=10)
    assert chunker.split(STORY, enabled=False) == [STORY]
    assert SentenceChunker(limit=50, target=30, first_target=10).split(STORY, enabled=False) == [
        "The cat sat on the mat. It was warm!", "Was it asleep? Nobody knew; the dog did not care.",
        "Then the rain came, and everyone went inside."]


def test_empty_text_has_no_pieces_and_a_bad_limit_is_refused():
    assert SentenceChunker(limit=10).split("  \n ") == []
    with pytest.raises(ValueError, match="limit"):
        SentenceChunker(limit=0)
