"""How an interleaved BAGEL prompt (text and images) is laid out in its one sequence.

BAGEL does not use a chat template. Each text piece is its own block,
``<|im_start|> text <|im_end|>``, its tokens at consecutive rope positions and causal. Each
image is a block ``<|vision_start|> patches… <|vision_end|>`` whose tokens all share one
rope position and attend to each other both ways; the rope position then moves on by one.
An answer is decoded from an ``<|im_start|>`` at the next rope position until
``<|im_end|>``.

Run block by block (as the reference runs them, one cache update each) or as one prefill,
the result is the same: a token sees every cache entry up to its ``mask position`` (its own
index for text, its block's last index for an image). ``layout`` makes the whole prompt's
positions for a one-pass prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecialTokens:
    """The ids BAGEL adds to Qwen2's tokenizer."""

    im_start: int  # <|im_start|>: opens every text block and the answer
    im_end: int  # <|im_end|>: closes a text block; the answer's stop token
    vision_start: int  # <|vision_start|>
    vision_end: int  # <|vision_end|>

    @classmethod
    def from_tokenizer(cls, tokenizer) -> SpecialTokens:
        ids = [tokenizer.convert_tokens_to_ids(t)
               for t in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")]
        return cls(*ids)


@dataclass(frozen=True)
class PromptLayout:
    """A prompt as one prefill: ``token_ids [L]`` (a patch row holds ``vision_start``, its
    embedding replaced by the image's), ``vision_rows [L]`` (True at patch rows, in image
    order), ``rope_positions [L]``, ``mask_positions [L]`` (the last cache index each token
    sees) and ``next_rope``, the answer's first rope position."""

    token_ids: torch.Tensor
    vision_rows: torch.Tensor
    rope_positions: torch.Tensor
    mask_positions: torch.Tensor
    next_rope: int

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def layout(blocks: list[list[int] | int], tokens: SpecialTokens, *, answer: bool = False) -> PromptLayout:
    """Lay out ``blocks`` in order: a list of token ids is a text block (wrapped here in
    ``<|im_start|> … <|im_end|>``), an int is an image of that many patches. ``answer``: end
    with the ``<|im_start|>`` that opens the answer (its logits give the answer's first token;
    ``next_rope`` is then the rope position after it)."""
    ids: list[int] = []
    vision: list[bool] = []
    rope: list[int] = []
    mask: list[int] = []
    position = 0
    for block in blocks:
        start = len(ids)
        if isinstance(block, int):
            ids += [tokens.vision_start] * (block + 1) + [tokens.vision_end]
            vision += [False] + [True] * block + [False]
            rope += [position] * (block + 2)
            mask += [start + block + 1] * (block + 2)
            position += 1
        else:
            text = [tokens.im_start, *block, tokens.im_end]
            ids += text
            vision += [False] * len(text)
            rope += range(position, position + len(text))
            mask += range(start, start + len(text))
            position += len(text)
    if answer:
        mask.append(len(ids))
        ids.append(tokens.im_start)
        vision.append(False)
        rope.append(position)
        position += 1
    long = torch.long
    return PromptLayout(torch.tensor(ids, dtype=long), torch.tensor(vision, dtype=torch.bool),
                        torch.tensor(rope, dtype=long), torch.tensor(mask, dtype=long), position)
