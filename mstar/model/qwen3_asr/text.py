"""Qwen3-ASR's languages and what becomes of its raw output.

The model writes ``language <Name><asr_text><transcript>`` (``language None<asr_text>`` for
audio with no speech); a forced language is put in the prompt instead, and the model then
writes only the transcript. A transcript caught in a repetition loop is collapsed as the
reference SDK does (``collapse_repetitions``).
"""

from __future__ import annotations

from mstar.contract import RequestError

# The 30 languages the model was trained to name, by ISO code (``yue``: Cantonese).
LANGUAGES = {
    "zh": "Chinese", "en": "English", "yue": "Cantonese", "ar": "Arabic", "de": "German", "fr": "French",
    "es": "Spanish", "pt": "Portuguese", "id": "Indonesian", "it": "Italian", "ko": "Korean", "ru": "Russian",
    "th": "Thai", "vi": "Vietnamese", "ja": "Japanese", "tr": "Turkish", "hi": "Hindi", "ms": "Malay",
    "nl": "Dutch", "sv": "Swedish", "da": "Danish", "fi": "Finnish", "pl": "Polish", "cs": "Czech",
    "fil": "Filipino", "fa": "Persian", "el": "Greek", "ro": "Romanian", "hu": "Hungarian", "mk": "Macedonian",
}
CODES = {name.lower(): code for code, name in LANGUAGES.items()}
ASR_TEXT = "<asr_text>"


def language_name(language: str) -> str:
    """The model's name of ``language`` (a code or a name, any case); a 400 naming the
    choices if it is not one of the 30."""
    key = language.strip().lower()
    if key in LANGUAGES:
        return LANGUAGES[key]
    if key in CODES:
        return LANGUAGES[CODES[key]]
    raise RequestError("language", f"Qwen3-ASR does not know {language!r}; use one of "
                                   f"{', '.join(sorted(LANGUAGES))} (or leave it out to detect it)")


def language_code(name: str) -> str:
    """The ISO code of a language name the model wrote ('' when it named none we know)."""
    return CODES.get(name.strip().lower(), "")


def _collapse_runs(text: str, threshold: int) -> str:
    """A character repeated more than ``threshold`` times in a row kept once."""
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(text[i] if j - i > threshold else text[i:j])
        i = j
    return "".join(out)


def _collapse_pattern(text: str, threshold: int, longest: int = 20) -> str:
    """From the first place where a pattern of 1..``longest`` characters repeats ``threshold``
    times in a row (the shortest such pattern), keep one copy, skip every further repeat, and
    go on the same way with the rest."""
    n, i = len(text), 0
    while i <= n - 2 * threshold:
        for k in range(1, longest + 1):
            if i + k * threshold > n:
                break
            pattern = text[i:i + k]
            if all(text[i + r * k:i + (r + 1) * k] == pattern for r in range(1, threshold)):
                end = i + threshold * k
                while end + k <= n and text[end:end + k] == pattern:
                    end += k
                return text[:i] + pattern + _collapse_pattern(text[end:], threshold, longest)
        i += 1
    return text


def collapse_repetitions(text: str, threshold: int = 20) -> str:
    """``text`` with repetition loops collapsed: long runs of one character first, then the
    first repeated pattern and each one after it."""
    return _collapse_pattern(_collapse_runs(text, threshold), threshold)


def parse_output(raw: str, forced: str | None, threshold: int = 20) -> tuple[str, str]:
    """``(language name, transcript)`` of the model's raw text; with a ``forced`` language the
    text is all transcript."""
    text = collapse_repetitions(raw.strip(), threshold)
    if not text:
        return forced or "", ""
    if forced:
        return forced, text
    if ASR_TEXT not in text:
        return "", text.strip()
    meta, transcript = text.split(ASR_TEXT, 1)
    if "language none" in meta.lower():
        return "", transcript.strip()
    name = ""
    for line in meta.splitlines():
        line = line.strip()
        if line.lower().startswith("language "):
            value = line[len("language "):].strip()
            name = value[:1].upper() + value[1:].lower()
            break
        if line:
            break
    return name, transcript.strip()


__all__ = ["LANGUAGES", "collapse_repetitions", "language_code", "language_name", "parse_output"]
