"""Text to T3 text ids, for the three Chatterbox variants.

* English: a grapheme BPE (``tokenizer.json``) over the text with every space spelled
  ``[SPACE]``; T3's own start / stop text tokens go around the ids (``T3TextEncoder``).
* Multilingual: the same over a 2454-token vocabulary
  (``grapheme_mtl_merged_expanded_v1.json``), after lower-casing and NFKD, a per-language
  step, and a ``[<language>]`` token in front. Korean syllables become conjoining jamo;
  Chinese characters become Cangjie codes (``[cj_x]`` per letter, ``[cj_.]`` after each) from
  the checkpoint's ``Cangjie5_TC.json``, word-segmented first when ``spacy_pkuseg`` is
  installed. Japanese kanji readings (``pykakasi``), Hebrew diacritics (``dicta_onnx``) and
  Russian stress marks (``russian_text_stresser``) need those packages, and are skipped with
  a warning without them, as the reference does.
* Turbo: GPT-2's byte-level BPE, no start / stop tokens.

The files are read with the ``tokenizers`` library, as the reference reads them. Before
tokenising, the reference tidies punctuation (``normalize_punctuation``), each variant a little
differently.
"""

from __future__ import annotations

import functools
import json
import logging
import unicodedata
from pathlib import Path

from tokenizers import Tokenizer

from mstar.model.chatterbox.config import T3Config, Variant

logger = logging.getLogger(__name__)

SPACE = "[SPACE]"
LANGUAGES = ("ar", "da", "de", "el", "en", "es", "fi", "fr", "he", "hi", "it", "ja", "ko", "ms", "nl", "no",
             "pl", "pt", "ru", "sv", "sw", "tr", "zh")

_COMMON_REPLACEMENTS = (("...", ", "), ("…", ", "), (":", ","), (" - ", ", "), (";", ", "), ("—", "-"),
                        ("–", "-"), (" ,", ","), ("“", '"'), ("”", '"'), ("‘", "'"), ("’", "'"))
_TURBO_REPLACEMENTS = (("…", ", "), (":", ","), ("—", "-"), ("–", "-"), (" ,", ","), ("“", '"'),
                       ("”", '"'), ("‘", "'"), ("’", "'"))
_ENDERS = (".", "!", "?", "-", ",")
_CJK_ENDERS = ("、", "，", "。", "？", "！")


def normalize_punctuation(text: str, variant: Variant) -> str:
    """The reference's ``punc_norm``: capitalise the first letter, collapse spaces, replace
    rare punctuation, end with a full stop if no sentence ender closes the text."""
    if not text:
        return "You need to add some text for me to talk."
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in _TURBO_REPLACEMENTS if variant == "turbo" else _COMMON_REPLACEMENTS:
        text = text.replace(old, new)
    text = text.rstrip(" ")
    enders = _ENDERS + _CJK_ENDERS if variant == "multilingual" else _ENDERS
    return text if text.endswith(enders) else text + "."


class GraphemeTokenizer:
    """The English grapheme BPE: spaces as ``[SPACE]``, then the file's tokenizer."""

    def __init__(self, path: str | Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(path))
        vocab = self.tokenizer.get_vocab()
        for special in ("[START]", "[STOP]"):
            if special not in vocab:
                raise ValueError(f"{path}: the vocabulary has no {special} token")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text.replace(" ", SPACE)).ids


def hangul_to_jamo(text: str) -> str:
    """Korean syllables decomposed into leading, vowel and (if any) trailing conjoining jamo."""
    out = []
    for char in text:
        code = ord(char) - 0xAC00
        if not 0 <= code <= 0xD7AF - 0xAC00:
            out.append(char)
            continue
        out.append(chr(0x1100 + code // 588) + chr(0x1161 + (code % 588) // 28))
        if code % 28:
            out.append(chr(0x11A7 + code % 28))
    return "".join(out).strip()


class CangjieTable:
    """Chinese characters as Cangjie codes, from the checkpoint's ``Cangjie5_TC.json`` (a list
    of ``"<char>\\t<code>..."`` entries). A code shared by several characters gets the
    character's index among them as a suffix (none for the first)."""

    def __init__(self, entries: list[str]) -> None:
        self.code_of: dict[str, str] = {}
        self.chars_of: dict[str, list[str]] = {}
        for entry in entries:
            char, code = entry.split("\t")[:2]
            self.code_of[char] = code
            self.chars_of.setdefault(code, []).append(char)
        self.segmenter = _optional_segmenter()

    @classmethod
    def from_file(cls, path: str | Path) -> CangjieTable:
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def code(self, char: str) -> str | None:
        code = self.code_of.get(char)
        if code is None:
            return None
        index = self.chars_of[code].index(char)
        return code + (str(index) if index > 0 else "")

    def __call__(self, text: str) -> str:
        if self.segmenter is not None:
            text = " ".join(self.segmenter.cut(text))
        out = []
        for char in text:
            code = self.code(char) if unicodedata.category(char) == "Lo" else None
            out.append(char if code is None else "".join(f"[cj_{c}]" for c in code) + "[cj_.]")
        return "".join(out)


def _optional_segmenter():
    try:
        from spacy_pkuseg import pkuseg
    except ImportError:
        logger.warning("spacy_pkuseg is not installed: Chinese text is not word-segmented")
        return None
    return pkuseg()


def _japanese_kana(text: str) -> str:
    """Kanji replaced by their hiragana reading (katakana kept), then NFKD, when ``pykakasi``
    is installed (the reference's ``hiragana_normalize``)."""
    kakasi = _optional("pykakasi", "kakasi", "Japanese text is tokenised without kana readings")
    if kakasi is None:
        return text
    out = []
    for part in kakasi.convert(text):
        orig, hira = part["orig"], part["hira"]
        if any(0x4E00 <= ord(c) <= 0x9FFF for c in orig):
            out.append(" " + hira if hira and hira[0] in ("は", "へ") else hira)
        else:
            out.append(orig)
    return unicodedata.normalize("NFKD", "".join(out))


def _hebrew_diacritics(text: str) -> str:
    dicta = _optional("dicta_onnx", "Dicta", "Hebrew text is tokenised without diacritics")
    return text if dicta is None else dicta.add_diacritics(text)


def _russian_stress(text: str) -> str:
    stresser = _optional("russian_text_stresser.text_stresser", "RussianTextStresser",
                         "Russian text is tokenised without stress marks")
    return text if stresser is None else stresser.stress_text(text)


@functools.cache
def _optional(module: str, factory: str, consequence: str):
    """One instance of an optional package's ``factory`` (made once), or None with a warning
    when the package is missing."""
    try:
        return getattr(__import__(module, fromlist=[factory]), factory)()
    except ImportError:
        logger.warning("%s is not installed: %s", module.split(".")[0], consequence)
        return None


class MultilingualTokenizer:
    """The 23-language grapheme BPE with its per-language preprocessing."""

    def __init__(self, path: str | Path, cangjie: CangjieTable | None = None) -> None:
        self.graphemes = GraphemeTokenizer(path)
        self.cangjie = cangjie

    def encode(self, text: str, language: str | None) -> list[int]:
        if language is not None and language not in LANGUAGES:
            raise ValueError(f"unsupported language {language!r}; expected one of {', '.join(LANGUAGES)}")
        text = unicodedata.normalize("NFKD", text.lower())
        if language == "zh":
            if self.cangjie is None:
                raise ValueError("Chinese needs the checkpoint's Cangjie5_TC.json table")
            text = self.cangjie(text)
        elif language == "ja":
            text = _japanese_kana(text)
        elif language == "he":
            text = _hebrew_diacritics(text)
        elif language == "ko":
            text = hangul_to_jamo(text)
        elif language == "ru":
            text = _russian_stress(text)
        if language is not None:
            text = f"[{language}]{text}"
        return self.graphemes.encode(text)


class TurboTokenizer:
    """GPT-2's byte-level BPE: ``tokenizer.json`` when the checkpoint has one, else
    ``vocab.json`` + ``merges.txt`` (with ``added_tokens.json``'s tags)."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if (directory / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            from tokenizers import decoders, models, pre_tokenizers

            bpe = models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
            self.tokenizer = Tokenizer(bpe)
            self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            self.tokenizer.decoder = decoders.ByteLevel()
            added = directory / "added_tokens.json"
            if added.is_file():
                tags = sorted(json.loads(added.read_text()).items(), key=lambda kv: kv[1])
                self.tokenizer.add_tokens([tag for tag, _ in tags])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def t3_text_ids(ids: list[int], config: T3Config) -> list[int]:
    """A request's text ids as T3 reads them: between the start / stop text tokens (English and
    multilingual; Turbo has none). More than the learned text position table's rows
    (``max_text_tokens`` + the two markers) is refused."""
    if config.guided:
        ids = [config.start_text_token, *ids, config.stop_text_token]
    limit = config.text_positions if config.learned_positions else config.backbone.max_position_embeddings
    if len(ids) > limit:
        raise ValueError(f"the text is {len(ids)} tokens; T3 reads at most {limit}")
    return ids
