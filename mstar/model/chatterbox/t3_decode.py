"""One T3 request decoded eagerly over the paged KV cache: the reference loop, step by step.

This is the eager path the serving engine is checked against: the prefill of the request's
rows (a guided pair is two sequences of one batch, ``cond`` and ``uncond``), then one speech
token per step for every row, the guided logits combined, filtered in the variant's order
(``sampling.py``) and drawn. It stops at the stop-speech token or after ``max_new_tokens``.

``PagedSequences`` is the small page bookkeeping both this loop and ``T3Engine`` use
(``PagePool`` for the pages and the KV caches, one ``PagedAttentionMetadata`` per step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mstar.contract import SamplingParams
from mstar.engine.page_pool import PagePool
from mstar.engine.sampler import seen_mask
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.chatterbox import sampling
from mstar.model.chatterbox.alignment import AlignmentGuard, AlignmentSpy
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.t3 import T3, guide


class PagedSequences:
    """Pages and KV caches for a few sequences, and the metadata of each step."""

    def __init__(self, model: T3, num_pages: int = 64, page_size: int = 16,
                 dtype: torch.dtype = torch.float32) -> None:
        layers, kv_heads, head_dim = model.cache_shape()
        device = model.speech_emb.weight.device
        self.pool = PagePool(num_pages, page_size)
        self.kv_caches = allocate_kv_cache(layers, num_pages, page_size, kv_heads, head_dim, dtype, device)
        self.device = device

    def step(self, chunks: list[tuple[str, int]]) -> PagedAttentionMetadata:
        """The metadata of a step adding ``n`` tokens to each ``(sequence, n)``, in order."""
        positions, slots, starts, lens = [], [], [0], []
        for seq, n in chunks:
            old = self.pool.seq_len(seq) if self.pool.has(seq) else 0
            self.pool.reserve(seq, old + n)
            positions.extend(range(old, old + n))
            slots.extend(self.pool.slots(seq, old, old + n))
            starts.append(starts[-1] + n)
            lens.append(old + n)
        tables = self.pool.tables([seq for seq, _ in chunks])
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return PagedAttentionMetadata(positions=tensor(positions), slot_mapping=tensor(slots),
                                      query_start_loc=tensor(starts), seq_lens=tensor(lens),
                                      page_table=tensor(table), page_size=self.pool.page_size,
                                      host_query_start_loc=tuple(starts), host_seq_lens=tuple(lens))

    def free(self, seqs: list[str]) -> None:
        for seq in seqs:
            if self.pool.has(seq):
                self.pool.free(seq)


@dataclass
class T3Request:
    """What one T3 decode needs. ``text_ids`` already carry the start / stop text tokens
    (English and multilingual) or none (Turbo); ``cfg_weight`` 0 runs no unconditional row."""

    cond: T3Conditioning
    text_ids: torch.Tensor
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    cfg_weight: float = 0.5
    max_new_tokens: int = 1000


@dataclass
class T3Result:
    tokens: list[int]  # the drawn speech tokens, the stop token included when it came
    logits: list[torch.Tensor]  # per step, the speech logits [rows, V] the step's draw read


@torch.inference_mode()
def generate(model: T3, request: T3Request, cache: PagedSequences,
             generator: torch.Generator | None = None) -> T3Result:
    """Decode one request over ``cache``, the reference's loop for the variant."""
    config = model.config
    guided = config.guided and request.cfg_weight > 0.0
    seqs = ["cond", "uncond"] if guided else ["cond"]
    cond_rows = model.conditioning(request.cond)
    prompt = model.prefill_embeds(cond_rows, request.text_ids, guided)
    length = prompt.shape[1]
    spy = guard = None
    if config.alignment_heads:
        spy = AlignmentSpy(model.tfmr.layers, config.alignment_heads)
        spy.watch([0])  # the conditional row
        text_start = cond_rows.shape[1]
        guard = AlignmentGuard((text_start, text_start + request.text_ids.numel()), config.stop_speech_token)
    tokens: list[int] = []
    logits_seen: list[torch.Tensor] = []
    try:
        hidden = model(prompt.reshape(-1, prompt.shape[-1]), cache.step([(s, length) for s in seqs]), cache.kv_caches)
        last = hidden.view(len(seqs), length, -1)[:, -1]
        for step in range(request.max_new_tokens):
            logits = model.speech_logits(last)
            logits_seen.append(logits)
            edit = None
            if guard is not None:
                last_token = tokens[-1] if tokens else config.start_speech_token
                edit = functools.partial(guard.step, attention=spy.attention(0), last_token=last_token)
            token = next_token(config, logits, tokens, request.sampling, request.cfg_weight, generator, edit)
            tokens.append(token)
            if finished(config, tokens, request.max_new_tokens):
                break
            speech_pos = torch.full((len(seqs),), step + 1, dtype=torch.long)
            embeds = model.speech_embeds(torch.full((len(seqs),), token, dtype=torch.long), speech_pos)
            last = model(embeds, cache.step([(s, 1) for s in seqs]), cache.kv_caches)
    finally:
        cache.free(seqs)
        if spy is not None:
            spy.remove()
    return T3Result(tokens, logits_seen)


def next_token(config: T3Config, logits: torch.Tensor, tokens: list[int], params: SamplingParams,
               cfg_weight: float, generator: torch.Generator | None,
               edit: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """The next speech token of a request from its rows' logits ``[rows, V]`` (``[cond,
    uncond]`` for a guided pair) and the tokens it drew so far: guided, edited (the alignment
    guard, ``alignment.py``), filtered in the variant's order, drawn."""
    combined = guide(logits[0:1], logits[1:2], cfg_weight) if logits.shape[0] == 2 else logits[0:1]
    if edit is not None:
        combined = edit(combined)
    history = _penalty_history(config.guided, config.start_speech_token, tokens)
    seen = seen_mask([history], combined.shape[-1], combined.device)
    scores = (sampling.guided_scores if config.guided else sampling.turbo_scores)(combined, [params], seen)
    return int(sampling.draw(scores, [params], [generator])[0])


def finished(config: T3Config, tokens: list[int], max_new_tokens: int) -> bool:
    """Whether a request stops after its last token: the stop-speech token (Turbo's reference
    looks for it from its second draw on) or the budget."""
    stopped = tokens[-1] == config.stop_speech_token and (config.guided or len(tokens) > 1)
    return stopped or len(tokens) >= max_new_tokens


def _penalty_history(guided: bool, start_speech: int, tokens: list[int]) -> list[int]:
    """The ids the repetition penalty reads: the guided loop's history starts with the
    start-of-speech token; Turbo's first step sees that token alone, later ones only the
    generated tokens."""
    if guided:
        return [start_speech, *tokens]
    return tokens if tokens else [start_speech]


S3GEN_SILENCE = 4299  # the S3 token Turbo appends three of, so the waveform ends in silence


def speech_tokens_for_s3gen(tokens: list[int], config: T3Config) -> list[int]:
    """T3's drawn tokens as the reference hands them to S3Gen. English and multilingual: what
    follows the first start-of-speech token (if one was drawn) up to the first stop token;
    English also drops every id outside S3's 6561 codes (the multilingual reference does not).
    Turbo: a trailing stop token removed, ids outside the codes dropped, three silence tokens
    appended. (The reference's slicing fails on several start tokens; this takes the first.)"""
    codes = config.start_speech_token  # S3's codebook ends where T3's control tokens begin
    if config.is_gpt2:
        kept = tokens[:-1] if tokens and tokens[-1] == config.stop_speech_token else tokens
        return [t for t in kept if t < codes] + [S3GEN_SILENCE] * 3
    start = tokens.index(config.start_speech_token) + 1 if config.start_speech_token in tokens else 0
    end = tokens.index(config.stop_speech_token) if config.stop_speech_token in tokens else len(tokens)
    kept = tokens[start:end]
    return [t for t in kept if t < codes] if config.variant == "english" else kept
