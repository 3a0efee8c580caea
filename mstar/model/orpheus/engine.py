"""Orpheus's engines: the Llama talker writes an audio code beside each audio token, and
the SNAC node decodes windows of those codes into 24 kHz audio."""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass

import torch

from mstar.engine.base import EngineItem
from mstar.engine.cuda_graphs import BucketGraphs
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import to_device
from mstar.model.snac import SnacDecoder

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
        return {"code": code_value(code)}


def code_value(code: int) -> torch.Tensor:
    """The ``code`` output ``[1]`` of an audio code, shared by every row that writes it
    (outputs are never written to): a new tensor per row and step was a tenth of the talker's
    host work per row at 32 streams."""
    return _code_values()[code]


@functools.cache
def _code_values() -> tuple[torch.Tensor, ...]:
    """Every code's ``[1]`` output, made at once on first use (one op, views of one tensor):
    made one by one as codes first came up, a stream paid a ``torch.tensor`` on most of its
    first few thousand steps."""
    return torch.arange(CODEBOOK, dtype=torch.int64).view(-1, 1).unbind(0)


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


FRAME_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))  # a frame's 7 codes by SNAC level (``codes_from_orpheus``)


def decode_frames(decoder: SnacDecoder, codes: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
    """Audio ``[B, F * 2048]`` of ``codes [B, F * 7]`` (each row whole frames of Orpheus codes,
    offsets removed), as ``codes_from_orpheus`` + ``decode`` compute it row by row; ``levels``:
    ``FRAME_LEVELS`` as int64 tensors on the codes' device (no host copy: this runs inside
    a CUDA-graph capture)."""
    frames = codes.view(codes.shape[0], -1, TOKENS_PER_FRAME)
    split = [frames.index_select(2, cols).reshape(codes.shape[0], -1) for cols in levels]
    return decoder.decode(split, noise=False)[:, 0]


class SnacGraphs:
    """SNAC's decode of full windows (``frames`` frames a row) as per-bucket CUDA-graph
    replays. Launched eagerly the decoder is hundreds of small kernels a window (~12 ms of
    host time against ~1 ms of GPU work on an H200), paid every 7 talker steps; a replay
    launches them at once. Every row decodes on its own, so padding rows (code 0) change
    nothing. Off CUDA the buckets run eagerly (``BucketGraphs``)."""

    def __init__(self, decoder: SnacDecoder, frames: int, batch_sizes: list[int]) -> None:
        self.decoder = decoder
        self.frames = frames
        device = next(decoder.parameters()).device
        self.levels = [torch.tensor(cols, dtype=torch.int64, device=device) for cols in FRAME_LEVELS]
        codes = torch.zeros(max(batch_sizes), frames * TOKENS_PER_FRAME, dtype=torch.int64, device=device)
        self.graphs = BucketGraphs(lambda rows: decode_frames(decoder, rows["codes"], self.levels),
                                   {"codes": codes}, {"codes": 0}, batch_sizes)

    def capture_all(self) -> None:
        self.graphs.capture_all()

    def fits(self, codes: torch.Tensor) -> bool:
        return codes.shape[1] == self.frames * TOKENS_PER_FRAME and self.graphs.fits(codes.shape[0])

    def run(self, codes: torch.Tensor) -> torch.Tensor:
        return self.graphs.run(codes.shape[0], {"codes": codes})


def snac_fn(decoder: SnacDecoder, graphs: SnacGraphs | None = None):
    """The codec node: each chunk's whole frames decoded, the kept frames' samples emitted.
    Chunks with the same number of frames are decoded as one batch (a replay of ``graphs``
    when it has their frame count). On CUDA the codec runs on a stream of its own: its codes
    come from the host, so it never waits for the talker's step queued ahead of it, and the
    one read of a batch's audio waits for the codec's kernels only."""
    device = next(decoder.parameters()).device
    levels = [torch.tensor(cols, dtype=torch.int64, device=device) for cols in FRAME_LEVELS]
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def decode(codes: torch.Tensor) -> torch.Tensor:
        if graphs is not None and graphs.fits(codes):
            return graphs.run(codes)
        return decode_frames(decoder, codes.to(device), levels)

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
            codes = torch.stack([items[i].inputs["codes"].reshape(-1)[:tokens] for i in indices]).to(torch.int64)
            if bool(((codes < 0) | (codes >= CODEBOOK)).any()):
                raise ValueError(f"Orpheus codes must lie in [0, {CODEBOOK})")
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                audio = decode(codes).float().cpu()
            for row, i in enumerate(indices):
                chunk = items[i].chunk
                start = chunk.keep_start // TOKENS_PER_FRAME * SAMPLES_PER_FRAME
                end = min(chunk.keep_end // TOKENS_PER_FRAME, frames) * SAMPLES_PER_FRAME
                results[i] = {"audio": audio[row, start:end].clone()}
        return results  # type: ignore[return-value]

    return run
