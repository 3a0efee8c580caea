"""One utterance end to end on one request, eagerly: the reference path the served engines
are checked against (and what a test or a script can call directly).

``run_talker`` is the reference's talker ``generate`` with its defaults: codebook 0 never
draws the codec's special ids but EOS (the top 1024 ids of the talker vocabulary, the ids
above the codes on a smaller one), nor EOS before ``min_frames`` frames (``min_new_tokens``);
each frame's other codebooks come from the code predictor inside the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mstar.model.qwen3_omni.speech import new_caches, sequence_metadata
from mstar.model.qwen3_tts.prompt import TalkerPrompt
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker, Sampler

CodeChooser = Callable[[torch.Tensor, int], torch.Tensor]
"""``choose(logits [1, vocab], step) -> code0 [1]`` after the masks; ``None``: greedy."""


def suppressed_codes(talker: Qwen3TTSTalker) -> list[int]:
    """Codebook-0 ids never drawn: the codec's special ids but EOS. Released: the top 1024 ids
    (2048 .. 3071); on a vocabulary of 1024 ids or fewer, every id above the codes."""
    config = talker.config
    vocab, eos = config.text.vocab_size, config.codec_eos_token_id
    first = vocab - 1024 if vocab > 1024 else config.predictor.vocab_size
    return [i for i in range(first, vocab) if i != eos]


@torch.no_grad()
def run_talker(talker: Qwen3TTSTalker, prompt: TalkerPrompt, max_frames: int, *, min_frames: int = 2,
               choose: CodeChooser | None = None, sampler: Sampler | None = None,
               page_size: int = 16) -> torch.Tensor:
    """Codec frames ``[Q, T]`` until codebook 0 draws the codec EOS or ``T = max_frames``."""
    config = talker.config
    suppressed = suppressed_codes(talker)
    layers, heads, head_dim = talker.cache_shape()
    x = prompt.embeds
    caches = new_caches(layers, heads, head_dim, x.shape[0] + max_frames, page_size, x)
    frames, start = [], 0
    for step in range(max_frames):
        hidden = talker(x, sequence_metadata(start, x.shape[0], page_size, x.device), caches)[-1:]
        start += x.shape[0]
        logits = talker.compute_logits(hidden)
        logits[:, suppressed] = float("-inf")
        if step < min_frames:
            logits[:, config.codec_eos_token_id] = float("-inf")
        code0 = logits.argmax(dim=-1) if choose is None else choose(logits, step)
        if int(code0) == config.codec_eos_token_id:
            break
        frame = talker.predict_frame(hidden, code0, sampler)
        frames.append(frame.codes[0])
        x = frame.embeds + prompt.text_row(step)
    if not frames:
        return torch.zeros(config.num_code_groups, 0, dtype=torch.long, device=x.device)
    return torch.stack(frames, dim=1)


def prompt_ids(tokenizer, text: str, instruct: str | None) -> tuple[list[int], list[int] | None]:
    """The templated ids of an utterance and of its instruction (``None``: none)."""
    from mstar.model.qwen3_tts.prompt import assistant_text, instruct_text

    ids = tokenizer(assistant_text(text), add_special_tokens=False)["input_ids"]
    extra = tokenizer(instruct_text(instruct), add_special_tokens=False)["input_ids"] if instruct else None
    return list(ids), extra


def frames_to_codes(frames: Sequence[torch.Tensor]) -> torch.Tensor:
    """Frames ``[Q]`` each to codes ``[1, Q, T]`` for the codec."""
    return torch.stack(list(frames), dim=1)[None]
