"""Canary's decoder prompt: the multitask tokens NeMo's Canary-2 prompt format starts a
transcript with, looked up by name in the checkpoint's tokenizer.

``<|startofcontext|> <|startoftranscript|> <|emo:undefined|> <|src|> <|tgt|> <|pnc|>|<|nopnc|>
<|noitn|> <|notimestamp|> <|nodiarize|>``: the speech's language, the transcript's (the same
for transcription, another for translation), punctuation and capitalisation on or off, no
inverse text normalisation, timestamps or diarisation.
"""

from __future__ import annotations

# The 25 languages of Canary 1B v2 (its speech, and its translations to and from English).
LANGUAGES = frozenset("bg hr cs da nl en et fi fr de el hu it lv lt mt pl pt ro sk sl es sv ru uk".split())
_FIXED = ("<|startofcontext|>", "<|startoftranscript|>", "<|emo:undefined|>", "<|pnc|>", "<|nopnc|>",
          "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>", "<|endoftext|>")


class CanaryPrompt:
    """The prompt ids of a request; a checkpoint whose tokenizer lacks one of the tokens fails
    when this is made, naming it."""

    def __init__(self, tokenizer) -> None:
        def token(name: str) -> int:
            index = tokenizer.token_to_id(name)
            if index is None:
                raise ValueError(f"the checkpoint's tokenizer has no {name} token (a Canary-2 prompt needs it)")
            return index

        self.ids = {name: token(name) for name in _FIXED}
        self.languages = {code: token(f"<|{code}|>") for code in LANGUAGES}
        self.eos = self.ids["<|endoftext|>"]

    def __call__(self, source: str, target: str, punctuation: bool = True) -> list[int]:
        ids = self.ids
        return [ids["<|startofcontext|>"], ids["<|startoftranscript|>"], ids["<|emo:undefined|>"],
                self.languages[source], self.languages[target], ids["<|pnc|>" if punctuation else "<|nopnc|>"],
                ids["<|noitn|>"], ids["<|notimestamp|>"], ids["<|nodiarize|>"]]
