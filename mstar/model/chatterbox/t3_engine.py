"""T3's decode engine: many requests' prefills and decodes in one forward per step, a guided
request's conditional and unconditional rows as two KV sequences of the same batch.

The shared ``AutoregressiveEngine`` samples each sequence from its own logits; a guided T3
request draws one token from two sequences' logits combined, feeds that token to both, and
its prompt is embeddings rather than ids. This engine does exactly that and nothing more: an
eager step per ``run`` (no CUDA graphs, no overlap, no preemption: pages that run out fail the
step, and the worker retries each item alone), the token choice of the eager loop
(``t3_decode.next_token``), so a request's tokens are those of ``t3_decode.generate``.

Items: ``prefill`` reads ``speaker_emb [1, S]``, ``prompt_tokens [1, P]`` and ``text_ids [T]``
(start / stop text tokens in place) with params ``sampling`` (``SamplingParams`` fields),
``cfg_weight``, ``exaggeration``, ``max_new_tokens`` and ``seed``; ``decode`` reads nothing
(the engine keeps each request's tokens). Each step writes ``token``, and raises ``stop`` on
the stop-speech token or at the budget. The multilingual model's alignment guard
(``alignment.py``) watches each request's conditional row.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from mstar.contract import SamplingParams
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.model.chatterbox.alignment import AlignmentGuard, AlignmentSpy
from mstar.model.chatterbox.conditioning import T3Conditioning
from mstar.model.chatterbox.t3 import T3
from mstar.model.chatterbox.t3_decode import PagedSequences, finished, next_token


@dataclass
class T3Sequence:
    rows: list[str]  # its KV sequences: [cond] or [cond, uncond]
    sampling: SamplingParams
    cfg_weight: float
    max_new_tokens: int
    generator: torch.Generator | None
    guard: AlignmentGuard | None = None
    tokens: list[int] = field(default_factory=list)


class T3Engine(Engine):
    def __init__(self, model: T3, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.cache = PagedSequences(model, num_pages, page_size, dtype)
        self.requests: dict[str, T3Sequence] = {}
        heads = model.config.alignment_heads
        self.spy = AlignmentSpy(model.tfmr.layers, heads) if heads else None

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        fresh = [item.request_id for item in items if item.op == "prefill"]
        pool = self.cache.pool
        held = {row: pool.seq_len(row) for item in items if item.request_id in self.requests
                for row in self.requests[item.request_id].rows if pool.has(row)}
        try:
            with torch.inference_mode():
                return self._step(items)
        except BaseException:  # undo, so the worker can retry each item alone
            for request_id in fresh:
                self.release(request_id)
            for row, length in held.items():  # the pages reserved for the failed step
                pool.truncate(row, length)
            raise

    def _step(self, items: list[EngineItem]) -> list[EngineOutput]:
        chunks: list[tuple[str, int]] = []
        embeds: list[torch.Tensor] = []
        for item in items:
            rows = self._prefill(item) if item.op == "prefill" else self._decode(item)
            seq = self.requests[item.request_id]
            chunks.extend((row, rows.shape[1]) for row in seq.rows)
            embeds.append(rows.reshape(-1, rows.shape[-1]))
        firsts = list(itertools.accumulate((len(self.requests[item.request_id].rows) for item in items), initial=0))
        if self.spy is not None:  # each guarded request's conditional row
            self.spy.watch([firsts[i] for i, item in enumerate(items) if self.requests[item.request_id].guard])
        meta = self.cache.step(chunks)
        hidden = self.model(torch.cat(embeds), meta, self.cache.kv_caches)
        logits = self.model.speech_logits(hidden[meta.query_start_loc[1:] - 1])
        config = self.model.config
        outputs = []
        for item, row in zip(items, firsts):
            seq = self.requests[item.request_id]
            edit = None
            if seq.guard is not None:
                last = seq.tokens[-1] if seq.tokens else config.start_speech_token
                edit = functools.partial(seq.guard.step, attention=self.spy.attention(row), last_token=last)
            token = next_token(config, logits[row : row + len(seq.rows)], seq.tokens, seq.sampling,
                               seq.cfg_weight, seq.generator, edit)
            seq.tokens.append(token)
            done = finished(self.model.config, seq.tokens, seq.max_new_tokens)
            stop = token == self.model.config.stop_speech_token
            outputs.append(EngineOutput({"token": torch.tensor([token])}, flags=("stop",) if done else (),
                                        finish_reason=("stop" if stop else "length") if done else None))
        return outputs

    def _prefill(self, item: EngineItem) -> torch.Tensor:
        """The request taken in; its prompt rows ``[rows, L, hidden]``."""
        params, inputs = item.params, item.inputs
        if item.request_id in self.requests:
            raise ValueError(f"request {item.request_id!r} is already decoding")
        cfg_weight = float(params.get("cfg_weight", 0.5))
        guided = self.model.config.guided and cfg_weight > 0.0
        seed = params.get("seed")
        self.requests[item.request_id] = T3Sequence(
            rows=[f"{item.request_id}/cond"] + ([f"{item.request_id}/uncond"] if guided else []),
            sampling=SamplingParams(**params.get("sampling", {})), cfg_weight=cfg_weight,
            max_new_tokens=int(params.get("max_new_tokens", 1000)),
            generator=None if seed is None else torch.Generator(self.cache.device).manual_seed(int(seed)),
        )
        cond = T3Conditioning(inputs["speaker_emb"], inputs["prompt_tokens"], float(params.get("exaggeration", 0.5)))
        cond_rows = self.model.conditioning(cond)
        text_ids = inputs["text_ids"].reshape(-1)
        if self.spy is not None:
            start = cond_rows.shape[1]
            seq = self.requests[item.request_id]
            seq.guard = AlignmentGuard((start, start + text_ids.numel()), self.model.config.stop_speech_token)
        return self.model.prefill_embeds(cond_rows, text_ids, guided)

    def _decode(self, item: EngineItem) -> torch.Tensor:
        """The request's last token, embedded at its speech position, for each of its rows."""
        seq = self.requests[item.request_id]
        count = len(seq.rows)
        token = torch.full((count,), seq.tokens[-1], dtype=torch.long)
        position = torch.full((count,), len(seq.tokens), dtype=torch.long)
        return self.model.speech_embeds(token, position)[:, None]

    def release(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.cache.free(seq.rows)

    def stats(self) -> dict[str, float]:
        return {"kv_pages_used": float(self.cache.pool.num_used_pages)}
