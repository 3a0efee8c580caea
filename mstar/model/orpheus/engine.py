"""Orpheus's engines: the Llama talker writes an audio code beside each audio token, and
the SNAC node decodes windows of those codes into 24 kHz audio."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from mstar.engine.base import EngineItem
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import to_device
from mstar.model.snac import SnacDecoder, codes_from_orpheus

# Orpheus's vocabulary: Llama 3's, then control tokens, then 7 x 4096 audio codes.
START_OF_HUMAN = 128259
END_OF_TEXT = 128009
END_OF_HUMAN = 128260
START_OF_AI = 128261
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
AUDIO_BASE = 128266
CODEBOOK = 4096
TOKENS_PER_FRAME = 7
SAMPLES_PER_FRAME = 2048


def audio_code_range(count: int) -> tuple[int, int]:
    """The token ids ``[lo, hi)`` that are a valid code at the ``count``-th audio position."""
    lo = AUDIO_BASE + (count % TOKENS_PER_FRAME) * CODEBOOK
    return lo, lo + CODEBOOK


@dataclass
class TalkerState:
    audio_only: bool  # request param ``audio_only``
    codes: int = 0  # audio codes written since speech (re)started: the position in the frame


class TalkerRules(TokenRules):
    """The talker (Orpheus's Llama decoder, an ``AutoregressiveEngine``) writes, besides each
    token, its SNAC ``code``: the token's offset for its position in the frame removed, and
    silent for a token that is not a valid code there, as the reference streaming decoder
    skips such tokens.

    Request param ``audio_only`` (set by the deployment's benchmarking knob
    ``model_kwargs.benchmark_audio_only``): every token is sampled among the valid codes of
    its position in the frame, so each step yields one code however the weights look. A step
    launched ahead (``lead`` 1) is one code further along than the host has seen (such a
    row's every token is a code), so these rules never hold a row back.
    """

    extra_outputs = True

    def start(self, params: dict) -> TalkerState:
        return TalkerState(audio_only=bool(params.get("audio_only", False)))

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        if any(seq.state.audio_only for seq in seqs):
            logits = restrict_to_audio_codes(logits, seqs, lead)
        return sample(logits, seqs)

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        state: TalkerState = seq.state
        if token == START_OF_SPEECH:  # speech (re)starts: frames count from here
            state.codes = 0
            return {}
        if token < AUDIO_BASE:
            return {}
        code = token - AUDIO_BASE - (state.codes % TOKENS_PER_FRAME) * CODEBOOK
        if not 0 <= code < CODEBOOK:
            return {}
        state.codes += 1
        return {"code": torch.tensor([code], dtype=torch.int64)}


def restrict_to_audio_codes(logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
    """``logits [B, V]`` with every id outside the valid code range of the position ``lead``
    codes after the host's count set to -inf, for the rows whose sequence is ``audio_only``
    (other rows unchanged)."""
    vocab = logits.shape[-1]
    bounds = [audio_code_range(seq.state.codes + lead) if seq.state.audio_only else (0, vocab) for seq in seqs]
    lo, hi = to_device(torch.tensor(bounds, dtype=torch.int64), logits.device).unbind(-1)  # no wait on the GPU
    ids = torch.arange(vocab, device=logits.device)
    keep = (ids >= lo[:, None]) & (ids < hi[:, None])
    return logits.masked_fill(~keep, float("-inf"))


def snac_fn(decoder: SnacDecoder):
    """The codec node: each chunk's whole frames decoded, the kept frames' samples emitted.
    Chunks with the same number of frames are decoded as one batch."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        results: list[dict[str, torch.Tensor] | None] = [None] * len(items)
        by_frames: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_frames[item.inputs["codes"].numel() // TOKENS_PER_FRAME].append(i)
        for frames, indices in by_frames.items():
            if frames == 0:
                for i in indices:
                    results[i] = {"audio": torch.zeros(0)}
                continue
            tokens = frames * TOKENS_PER_FRAME
            codes = [codes_from_orpheus(items[i].inputs["codes"][:tokens].tolist()) for i in indices]
            device = next(decoder.parameters()).device
            batch = [torch.cat([c[level] for c in codes]).to(device) for level in range(3)]
            audio = decoder.decode(batch, noise=False)[:, 0]
            for row, i in enumerate(indices):
                chunk = items[i].chunk
                start = chunk.keep_start // TOKENS_PER_FRAME * SAMPLES_PER_FRAME
                end = min(chunk.keep_end // TOKENS_PER_FRAME, frames) * SAMPLES_PER_FRAME
                results[i] = {"audio": audio[row, start:end].float().cpu()}
        return results  # type: ignore[return-value]

    return run
