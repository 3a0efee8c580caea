"""S2's prompt layout and constrained slow-token logits."""

from __future__ import annotations

import pytest
import torch

from mstar.model.fish_s2_pro.prompt import Reference, build_prompt, slow_candidates, slow_token_mask

BEGIN = 1000


class CharTokenizer:
    """A token per character (a special token ``<|...|>`` is one token), as the real
    tokenizer keeps special tokens whole."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        import re

        ids = []
        for piece in re.findall(r"<\|[^|]+\|>|.", text, flags=re.S):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.vocab)
                self.pieces.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] if i < BEGIN else f"<S{i - BEGIN}>" for i in ids)


def test_cloning_prompt_layout():
    tok = CharTokenizer()
    codes = torch.tensor([[3, 7], [1, 2], [0, 5]])  # 3 codebooks, 2 frames
    tokens, frame_codes = build_prompt(tok, "Hi [laugh] there", [Reference("ref words", codes)], BEGIN, 3)
    assert tok.decode(tokens.tolist()) == (
        "<|im_start|>system\nconvert the provided text to speech reference to the following:\n\nText:\n"
        "<|speaker:0|>ref words\n\nSpeech:\n<S3><S7><|im_end|>\n<|im_start|>user\nHi [laugh] there<|im_end|>\n"
        "<|im_start|>assistant\n<|voice|>")
    frames = (tokens >= BEGIN).nonzero()[:, 0]
    assert frame_codes[frames].tolist() == [[3, 1, 0], [7, 2, 5]]
    assert frame_codes[tokens < BEGIN].abs().sum() == 0


def test_plain_prompt_and_tagged_reference():
    tok = CharTokenizer()
    tokens, _ = build_prompt(tok, "Hello", [], BEGIN, 3)
    assert tok.decode(tokens.tolist()).startswith("<|im_start|>system\nconvert the provided text to speech<|im_end|>")
    tokens, _ = build_prompt(tok, "x", [Reference("<|speaker:2|>kept", torch.zeros(3, 1, dtype=torch.int64))],
                             BEGIN, 3)
    assert "Text:\n<|speaker:2|>kept\n" in tok.decode(tokens.tolist())


def test_slow_token_mask_keeps_semantic_and_im_end():
    logits = torch.zeros(2, 20)
    masked = slow_token_mask(logits, semantic_begin_id=10, codebook_size=4, eos_id=3)
    kept = torch.isfinite(masked[0]).nonzero()[:, 0].tolist()
    assert kept == [3, 10, 11, 12, 13]


@pytest.mark.parametrize("eos", [3, 17])
def test_slow_candidates_are_the_masks_finite_entries_in_id_order(eos):
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(eos))
    masked = slow_token_mask(logits, semantic_begin_id=10, codebook_size=4, eos_id=eos)
    candidates, ids = slow_candidates(logits, semantic_begin_id=10, codebook_size=4, eos_id=eos)
    kept = torch.isfinite(masked[0]).nonzero()[:, 0].tolist()
    assert ids == kept and torch.equal(candidates, logits[:, kept])
    assert [ids[i] for i in candidates.argmax(dim=1).tolist()] == masked.argmax(dim=1).tolist()
