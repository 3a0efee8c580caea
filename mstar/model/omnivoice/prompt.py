"""An OmniVoice request's conditional canvas row: language, text, target length.

The row is, left to right: style tokens (``<|denoise|>`` when cloning, then
``<|lang_start|>{id or None}<|lang_end|><|instruct_start|>None<|instruct_end|>``), the text
``<|text_start|>{ref_text} {text}<|text_end|>`` (the non-verbal tags such as ``[laughter]``
tokenised on their own, so they get the same ids in any script), the reference clip's codes
if cloning, and ``T`` masked target frames. Text ids fill every codebook row alike.

``T`` comes from a character-weight rule: each character counts by its script (a Latin
letter 1, a CJK ideograph 3, Hangul 2.5, kana 2.2, Indic 1.8, Thai/Lao 1.5, digits 3.5,
punctuation 0.5, a space 0.2, combining marks 0); the reference clip's frames per unit weight
set the speaking rate (without a clip, 25 frames for "Nice to meet you."), and short estimates
(under 50 frames) are lengthened along ``50 * (T/50)^(1/3)``.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from functools import cache, lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NONVERBAL_TAGS = ("laughter", "sigh", "confirmation-en", "question-en", "question-ah", "question-oh",
                  "question-ei", "question-yi", "surprise-ah", "surprise-oh", "surprise-wa", "surprise-yo",
                  "dissatisfaction-hnn")
_TAG = re.compile(r"\[(?:" + "|".join(re.escape(t) for t in NONVERBAL_TAGS) + r")\]")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_END_MARKS = frozenset(";:,.!?…)]}\"'“”‘’；：，。！？、）】")
DEFAULT_REF_TEXT, DEFAULT_REF_FRAMES = "Nice to meet you.", 25

# Script weights (relative speaking time, a Latin letter = 1), by the start of a character's
# Unicode name; the first matching prefix wins.
_SCRIPT_WEIGHTS = (
    (("CJK", "BOPOMOFO", "YI ", "ETHIOPIC"), 3.0),
    (("HANGUL",), 2.5),
    (("HIRAGANA", "KATAKANA"), 2.2),
    (("DEVANAGARI", "BENGALI", "GURMUKHI", "GUJARATI", "ORIYA", "TAMIL", "TELUGU", "KANNADA",
      "MALAYALAM", "SINHALA", "TIBETAN", "KHMER", "MYANMAR", "JAVANESE", "BALINESE", "SUNDANESE"), 1.8),
    (("THAI", "LAO"), 1.5),
    (("ARABIC", "SYRIAC", "HEBREW"), 1.5),
)


@lru_cache(maxsize=8192)
def char_weight(ch: str) -> float:
    """One character's share of speaking time."""
    if ch.isascii() and ch.isalpha():
        return 1.0
    if ch == " ":
        return 0.2
    if ch == "\u0640":  # Arabic tatweel: a stretch mark, not a sound
        return 0.0
    category = unicodedata.category(ch)
    if category[0] == "M":
        return 0.0
    if category[0] in "PS":
        return 0.5
    if category[0] == "Z":
        return 0.2
    if category[0] == "N":
        return 3.5
    name = unicodedata.name(ch, "")
    for prefixes, weight in _SCRIPT_WEIGHTS:
        if name.startswith(prefixes):
            return weight
    if ord(ch) >= 0x20000:  # CJK extensions beyond the basic plane
        return 3.0
    return 1.0


def text_weight(text: str) -> float:
    return sum(char_weight(ch) for ch in text)


def target_frames(text: str, ref_text: str | None, ref_frames: int | None, speed: float = 1.0) -> int:
    """Frames to generate for ``text`` at the rate the reference (or the default) speaks."""
    if not ref_text or not ref_frames:
        ref_text, ref_frames = DEFAULT_REF_TEXT, DEFAULT_REF_FRAMES
    ref_weight = text_weight(ref_text)
    if ref_weight == 0:
        estimate = 0.0
    else:
        estimate = text_weight(text) / (ref_weight / ref_frames)  # weight per frame, as the reference rounds
        if estimate < 50:
            estimate = 50 * (estimate / 50) ** (1 / 3)
    if speed > 0 and speed != 1.0:
        estimate /= speed
    return max(1, int(estimate))


def combine_text(text: str, ref_text: str | None = None) -> str:
    """The transcript and the text as one line: newlines dropped, full-width parentheses made
    ASCII, runs of spaces and tabs made one space, and no space next to a CJK ideograph."""
    joined = f"{ref_text.strip()} {text.strip()}" if ref_text else text.strip()
    joined = re.sub(r"[\r\n]+", "", joined).replace("\uff08", "(").replace("\uff09", ")")
    joined = re.sub(r"[ \t]+", " ", joined)
    return re.sub(r"(?<=[\u4e00-\u9fff])\s+|\s+(?=[\u4e00-\u9fff])", "", joined)


def end_with_punctuation(text: str) -> str:
    """A transcript closed with a full stop (``。`` for Chinese) when it lacks a closing mark."""
    text = text.strip()
    if text and text[-1] not in _END_MARKS:
        text += "。" if _CJK.search(text) else "."
    return text


@cache
def languages() -> dict[str, str]:
    """Lower-case language name -> the id the model was trained with (``languages.tsv``)."""
    table = {}
    for line in (Path(__file__).parent / "languages.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            name, code = line.split("\t")
            table[name] = code
    return table


def resolve_language(value: str | None) -> str | None:
    """The trained id for a language id or name (any case); None for none, or, with a warning,
    for one the model does not know (it then speaks language-agnostically)."""
    if value is None or value.lower() == "none":
        return None
    table = languages()
    if value in set(table.values()):
        return value
    if value.lower() in table:
        return table[value.lower()]
    log.warning("OmniVoice: language %r is not one the model knows; speaking without a language", value)
    return None


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special).ids)


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenised with each non-verbal tag on its own."""
    ids, last = [], 0
    for match in _TAG.finditer(text):
        ids += _encode(tokenizer, text[last:match.start()], False) if match.start() > last else []
        ids += _encode(tokenizer, match.group(), False)
        last = match.end()
    if last < len(text):
        ids += _encode(tokenizer, text[last:], False)
    return ids or _encode(tokenizer, text, True)


def prompt_row(tokenizer, rows: int, mask_id: int, text: str, target_len: int, *, language: str | None,
               ref_text: str | None = None, ref_codes: torch.Tensor | None = None,
               denoise: bool = True) -> tuple[torch.Tensor, int]:
    """The conditional row ``[rows, L]`` and where its audio starts (see the module doc)."""
    style = "<|denoise|>" if denoise and ref_codes is not None else ""
    style += f"<|lang_start|>{language or 'None'}<|lang_end|><|instruct_start|>None<|instruct_end|>"
    ids = _encode(tokenizer, style, True)
    ids += text_ids(tokenizer, f"<|text_start|>{combine_text(text, ref_text)}<|text_end|>")
    head = torch.tensor(ids, dtype=torch.long)[None].expand(rows, -1)
    parts = [head]
    if ref_codes is not None:
        parts.append(ref_codes.long())
    parts.append(torch.full((rows, target_len), mask_id, dtype=torch.long))
    return torch.cat(parts, dim=1).contiguous(), len(ids)
