"""BAGEL's tokenizer for tiny test models: a byte-level Qwen2 tokenizer over 96 ids with BAGEL's
special tokens, free of bagel2 (``tests/support/bagel_reference.py`` re-exports it beside the
reference models; ``benchmarks/s10_bagel.py`` writes it into a dummy-weight checkpoint)."""

from __future__ import annotations

VOCAB = 96
TOKENS = dict(bos_token_id=90, eos_token_id=91, start_of_image=92, end_of_image=93)
"""The special ids BAGEL adds to its tokenizer (``<|im_start|>``, ``<|im_end|>``,
``<|vision_start|>``, ``<|vision_end|>``), in the tiny vocabulary."""

NAMED = {TOKENS["bos_token_id"]: "<|im_start|>", TOKENS["eos_token_id"]: "<|im_end|>",
         TOKENS["start_of_image"]: "<|vision_start|>", TOKENS["end_of_image"]: "<|vision_end|>",
         94: "<|endoftext|>", 95: "<|fill|>"}


def tokenizer():
    """A byte-level Qwen2 tokenizer over the tiny vocabulary: 90 characters (the space, letters,
    digits, then punctuation), then BAGEL's special tokens at the ids of ``TOKENS``."""
    import string

    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    first = ["\u0120", *string.ascii_letters, *string.digits, *string.punctuation]  # the space is "\u0120"
    chars = (first + [c for c in alphabet if c not in first])[:90]
    vocab = {c: i for i, c in enumerate(chars)} | {name: i for i, name in NAMED.items()}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|endoftext|>", unk_token=None)
    tok.add_tokens(list(NAMED.values()), special_tokens=True)
    return tok
