"""Whisper's special tokens, languages and decoder prompts, from ``tokenizer.json`` + CT2 config.

A Whisper decoder prompt is::

    [<|startofprev|> previous-text...]  <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>

(English-only checkpoints have no language/task tokens: ``<|startoftranscript|> <|notimestamps|>``).
With no language given, the prompt stops after ``<|startoftranscript|>`` so that the model's next
token, restricted to the language tokens, detects the language.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mstar.audio.languages import CODE_OF_NAME as _NAME_TO_CODE
from mstar.audio.languages import LANGUAGE_ALIASES, LANGUAGES

__all__ = ["LANGUAGES", "LANGUAGE_ALIASES", "WhisperTokens", "repair_bpe_merges"]

logger = logging.getLogger(__name__)

TASKS = ("transcribe", "translate")
MAX_PROMPT_TOKENS = 223  # Whisper keeps the last n_text_ctx // 2 - 1 previous-text tokens


def repair_bpe_merges(spec: dict[str, Any]) -> list[str]:
    """Restore BPE merges missing from a byte-level ``tokenizer.json`` (in place).

    Byte-level BPE vocabularies list bytes first (ids 0-255), then the result of merge ``r`` at a
    rising id. A converter that takes the first merge for a header line drops ``"Ġ t"`` (the
    packaged Whisper tokenizer has exactly that defect), so ``" the"`` still round-trips but
    encodes as ``["Ġ", "the"]``. Every non-byte, non-added vocabulary token that no merge
    produces, and that splits into two vocabulary tokens in exactly one way, gets its merge back
    at the rank its id implies. Returns the restored merges.
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return []
    vocab: dict[str, int] = model["vocab"]
    as_pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    produced = {a + b for a, b in as_pairs}
    added = {t["content"] for t in spec.get("added_tokens", [])}
    restored: list[tuple[int, tuple[str, str]]] = []
    for token, token_id in vocab.items():
        if token_id < 256 or len(token) < 2 or token in produced or token in added:
            continue
        # A merge's parts must already exist, i.e. have lower ids than its result.
        splits = [
            (head, tail)
            for head, tail in ((token[:k], token[k:]) for k in range(1, len(token)))
            if vocab.get(head, token_id) < token_id and vocab.get(tail, token_id) < token_id
        ]
        if len(splits) == 1:
            restored.append((token_id, splits[0]))
    if not restored:
        return []
    ids = [vocab[a + b] for a, b in as_pairs]
    if ids != sorted(ids):
        logger.warning("BPE merges are not in vocabulary order; not repairing %d", len(restored))
        return []
    merged = sorted([*zip(ids, as_pairs, strict=True), *restored])
    as_string = bool(model["merges"]) and isinstance(model["merges"][0], str)
    model["merges"] = [f"{a} {b}" if as_string else [a, b] for _, (a, b) in merged]
    return [f"{a} {b}" for _, (a, b) in restored]


class WhisperTokens:
    """Whisper token ids and prompt construction around a fast tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, config: Mapping[str, Any]) -> None:
        self.tokenizer = tokenizer
        self._vocab: dict[str, int] = tokenizer.get_vocab()
        self.eot = self._required("<|endoftext|>")
        self.sot = self._required("<|startoftranscript|>")
        self.transcribe = self._required("<|transcribe|>")
        self.translate = self._required("<|translate|>")
        self.no_timestamps = self._required("<|notimestamps|>")
        self.sot_prev = self._required("<|startofprev|>")
        self.no_speech = self._first_of("<|nospeech|>", "<|nocaptions|>")
        # Timestamp tokens <|0.00|>... follow <|notimestamps|> in the model vocabulary.
        self.timestamp_begin = self.no_timestamps + 1
        self.lang_to_id: dict[str, int] = {}
        for token_id in config.get("lang_ids") or []:
            token = tokenizer.convert_ids_to_tokens(int(token_id))
            if not (isinstance(token, str) and token.startswith("<|") and token.endswith("|>")):
                raise ValueError(f"lang_ids entry {token_id} is not a language token: {token!r}")
            self.lang_to_id[token[2:-2]] = int(token_id)
        self.id_to_lang = {i: code for code, i in self.lang_to_id.items()}
        self.suppress_tokens: list[int] = [int(i) for i in config.get("suppress_ids") or []]
        self.begin_suppress_tokens: list[int] = [
            int(i) for i in config.get("suppress_ids_begin") or [220, self.eot]
        ]
        self.special_ids: frozenset[int] = frozenset(
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special
        ) | frozenset(tokenizer.all_special_ids)

    @classmethod
    def from_files(
        cls, tokenizer_json: str | os.PathLike[str], config_json: str | os.PathLike[str] | None
    ) -> WhisperTokens:
        """Build from a ``tokenizer.json`` and CTranslate2's ``config.json`` (optional)."""
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        if restored := repair_bpe_merges(spec):
            logger.info("%s lacks BPE merges %s; restored them", tokenizer_json, restored)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
            pad_token="<|endoftext|>",
        )
        config = json.loads(Path(config_json).read_text()) if config_json is not None else {}
        return cls(tokenizer, config)

    def _token_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def _required(self, token: str) -> int:
        token_id = self._token_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        return token_id

    def _first_of(self, *tokens: str) -> int:
        for token in tokens:
            if (token_id := self._token_id(token)) is not None:
                return token_id
        raise ValueError(f"tokenizer has none of {tokens}")

    @property
    def multilingual(self) -> bool:
        return bool(self.lang_to_id)

    @property
    def languages(self) -> dict[str, str]:
        """Code -> English name for the languages this checkpoint knows."""
        return {code: LANGUAGES.get(code, code) for code in self.lang_to_id}

    def language_code(self, language: str) -> str:
        """Normalise a language code or English name ("English", "en") to a known code."""
        key = language.strip().lower()
        code = key if key in self.lang_to_id else _NAME_TO_CODE.get(key)
        if code is None or code not in self.lang_to_id:
            known = ", ".join(self.lang_to_id) or "none (English-only model)"
            raise ValueError(f"unsupported language {language!r}; known: {known}")
        return code

    def prompt_ids(
        self, language: str | None = None, task: str = "transcribe", prompt: str | None = None
    ) -> list[int]:
        """Decoder prompt ids; ``language=None`` stops after SOT (for language detection)."""
        if task not in TASKS:
            raise ValueError(f"unsupported task {task!r}; expected one of {TASKS}")
        ids: list[int] = []
        if prompt and prompt.strip():
            text_ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
            ids = [self.sot_prev, *text_ids[-MAX_PROMPT_TOKENS:]]
        if not self.multilingual:
            if language is not None and language.strip().lower() not in ("en", "english"):
                raise ValueError(f"unsupported language {language!r} for an English-only model")
            if task != "transcribe":
                raise ValueError("an English-only model can only transcribe")
            return [*ids, self.sot, self.no_timestamps]
        if language is None:
            return [*ids, self.sot]
        task_id = self.transcribe if task == "transcribe" else self.translate
        return [*ids, self.sot, self.lang_to_id[self.language_code(language)], task_id,
                self.no_timestamps]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without special or timestamp tokens (leading space kept)."""
        keep = [i for i in map(int, ids) if i < self.timestamp_begin and i not in self.special_ids]
        return self.tokenizer.decode(keep, skip_special_tokens=True)
