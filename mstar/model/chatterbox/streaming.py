"""Chatterbox streamed synthesis: T3's tokens so far -> the next piece of continuous audio.

A streamed request's chunks each hand S3Gen every speech token so far. Per chunk:

* the flow re-runs over a window of the tokens: up to ``context`` settled tokens before the
  audio already sent (0: the whole history), then every newer token. Its starting noise is
  cut from one fixed field per request (absolute frame ``f`` always gets the field's column
  ``f``), so frames two chunks both decode start from the same noise and agree closely.
  Before the end the frames of the last look-ahead tokens (``S3Gen.held_frames``) are held
  back, as their encoding still lacks the tokens the look-ahead conv reads;
* the vocoder runs over the window's mel from ``VOCODER_CONTEXT`` frames before the audio
  already sent, so its convolutions see the same left context the whole decode would;
* before the end the last ``VOCODER_HOLD`` frames (the vocoder's right edge, which has not
  seen its right context yet) and a crossfade tail of ``CROSSFADE`` samples are not sent:
  the tail is kept and the next chunk's first ``CROSSFADE`` samples are a raised-cosine
  blend from it into the new decode. The HiFT source restarts each chunk (its sine phase
  differs from the previous chunk's); the blend hides that, with no step at the seam.

So the pieces of a stream tile the utterance exactly: they add up to the whole decode's
``2 * tokens * samples_per_frame`` samples, close to it but not sample-identical.

Chunks ready together share the flow solve: rows with equal voice-prompt shapes and the
same ``final`` stack into one padded ``token2mel`` (``token_lengths`` masks make a row's
frames those of its solo solve), up to ``MAX_ROWS`` rows a solve.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mstar.model.s3gen import S3Gen, S3GenPrompt

__all__ = ["CROSSFADE", "MAX_ROWS", "VOCODER_CONTEXT", "VOCODER_HOLD", "ChunkJob", "ChunkPlan", "StreamTails",
           "crossfade_ramp", "plan_chunk", "run_chunks", "sent_after", "solve_windows"]

CROSSFADE = 480  # samples (20 ms at 24 kHz) blended from one chunk's tail into the next
VOCODER_CONTEXT = 8  # mel frames of left context the vocoder re-reads before new audio
VOCODER_HOLD = 4  # mel frames at a non-final chunk's right edge not sent (no right context yet)
MAX_ROWS = 8  # rows of one shared flow solve
MAX_STREAMS = 1024  # streams whose tails are remembered (oldest forgotten first)


@dataclass(frozen=True)
class ChunkPlan:
    """Where one chunk works, in absolute positions of its utterance: the flow window's first
    token ``window``, the vocoder's first mel frame ``vocoder_from``, the frames the flow
    gives (``frames_end``, exclusive), the samples ``[sent, upto)`` this chunk sends and
    ``[upto, cut)`` it keeps as the tail (none once ``final``)."""

    window: int
    vocoder_from: int
    frames_end: int
    sent: int
    upto: int
    cut: int
    final: bool


def _cut(tokens: int, final: bool, held_frames: int, per_frame: int, upsample: int) -> int:
    """The samples a chunk over ``tokens`` speech tokens decodes well: all at the end, else
    up to the held-back look-ahead less the vocoder's unsettled right edge."""
    if final:
        return upsample * tokens * per_frame
    return max(0, (upsample * tokens - held_frames - VOCODER_HOLD) * per_frame)


def sent_after(tokens: int, held_frames: int, per_frame: int, upsample: int = 2) -> int:
    """Samples a stream has sent once a non-final chunk over ``tokens`` tokens ran: its cut
    less the tail. A function of the tokens alone, so no chunk needs the count kept."""
    return max(0, _cut(tokens, False, held_frames, per_frame, upsample) - CROSSFADE)


def plan_chunk(tokens: int, done: int, final: bool, context: int, held_frames: int, per_frame: int,
               upsample: int = 2) -> ChunkPlan:
    """The plan of a chunk over ``tokens`` speech tokens after chunks over the first ``done``.
    ``context``: settled tokens kept before the audio sent (0: all of them)."""
    sent = sent_after(done, held_frames, per_frame, upsample) if done else 0
    settled_frames = sent // per_frame
    window = max(0, settled_frames // upsample - context) if context > 0 else 0
    frames_end = upsample * tokens - (0 if final else held_frames)
    vocoder_from = max(upsample * window, settled_frames - VOCODER_CONTEXT)
    cut = max(sent, _cut(tokens, final, held_frames, per_frame, upsample))
    upto = cut if final else max(sent, cut - CROSSFADE)
    return ChunkPlan(window, vocoder_from, frames_end, sent, upto, cut, final)


def crossfade_ramp(samples: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Raised-cosine gains 0 -> 1 over ``samples`` (the new decode's share of the blend)."""
    return (1 - torch.cos(torch.linspace(0, math.pi, samples + 2, device=device, dtype=dtype)[1:-1])) / 2


class StreamTails:
    """Per stream: the tail the last chunk kept (its decode of the samples after those it
    sent), for the next chunk to blend from. The ``s3gen`` node is stateless for the
    runtime; this is a bounded cache beside it, and a miss only loses one seam's blend."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self.limit = limit
        self.state: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor:
        return self.state.get(key, torch.zeros(0))

    def put(self, key: str, tail: torch.Tensor) -> None:
        self.state[key] = tail
        self.state.move_to_end(key)
        while len(self.state) > self.limit:
            self.state.popitem(last=False)

    def drop(self, key: str) -> None:
        self.state.pop(key, None)


@dataclass
class ChunkJob:
    """One streamed chunk to decode: its speech tokens so far, voice prompt, fixed noise
    field ``[1, mel, frames]`` (prompt frames first), plan, and the tail kept before it."""

    key: str
    speech: list[int]
    prompt: S3GenPrompt
    field: torch.Tensor
    plan: ChunkPlan
    tail: torch.Tensor
    generator: torch.Generator


def _window_noise(field: torch.Tensor, prompt_frames: int, start: int, end: int) -> torch.Tensor:
    """The fixed field's noise for the prompt and absolute new frames ``[start, end)``."""
    return torch.cat([field[..., :prompt_frames], field[..., prompt_frames + start: prompt_frames + end]], dim=-1)


def solve_windows(s3gen: S3Gen, jobs: list[ChunkJob]) -> list[torch.Tensor]:
    """Each job's window mel ``[1, mel, frames_end - 2 * window]``, the jobs grouped into
    padded shared solves (equal prompt shapes and ``final``, ``MAX_ROWS`` at most)."""
    up = s3gen.config.encoder.upsample
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        shape = (tuple(job.prompt.tokens.shape), tuple(job.prompt.mel.shape), job.plan.final)
        groups.setdefault(shape, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(jobs)
    for members in groups.values():
        for at in range(0, len(members), MAX_ROWS):
            rows = members[at: at + MAX_ROWS]
            for i, mel in zip(rows, _solve_rows(s3gen, [jobs[i] for i in rows], up)):
                out[i] = mel
    return out  # type: ignore[return-value]


def _solve_rows(s3gen: S3Gen, jobs: list[ChunkJob], up: int) -> list[torch.Tensor]:
    """One padded flow solve over ``jobs`` (same prompt shape and ``final``)."""
    final = jobs[0].plan.final
    device = jobs[0].field.device
    windows = [job.speech[job.plan.window:] for job in jobs]
    lengths = torch.tensor([len(w) for w in windows], device=device)
    longest = int(lengths.max())
    tokens = torch.tensor([w + [0] * (longest - len(w)) for w in windows], device=device)
    prompt_frames = up * jobs[0].prompt.tokens.shape[1]
    width = prompt_frames + up * longest - (0 if final else s3gen.held_frames)
    noise = torch.zeros(len(jobs), jobs[0].field.shape[1], width, device=device, dtype=jobs[0].field.dtype)
    for row, job in enumerate(jobs):
        part = _window_noise(job.field, prompt_frames, up * job.plan.window, job.plan.frames_end)
        noise[row, :, : part.shape[-1]] = part[0]
    prompt = S3GenPrompt(torch.cat([j.prompt.tokens for j in jobs]), torch.cat([j.prompt.mel for j in jobs]),
                         torch.cat([j.prompt.xvector for j in jobs]))
    mel = s3gen.token2mel(tokens, prompt, noise, token_lengths=lengths if len(jobs) > 1 else None, finalize=final)
    return [mel[row: row + 1, :, : job.plan.frames_end - up * job.plan.window] for row, job in enumerate(jobs)]


def vocode_window(s3gen: S3Gen, job: ChunkJob, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples this chunk sends and the tail it keeps, from its window ``mel``; the first
    samples sent are blended from the previous chunk's tail."""
    plan, up = job.plan, s3gen.config.encoder.upsample
    per_frame = s3gen.config.vocoder.samples_per_frame
    if plan.cut <= plan.sent:
        return torch.zeros(0), job.tail
    mel = mel[..., plan.vocoder_from - up * plan.window:]
    if plan.vocoder_from == 0:
        wave = s3gen.mel2wav(mel, job.generator)[0].float()
    else:  # mid-utterance: no fade-in of the head
        wave = s3gen.vocoder(mel, generator=job.generator)[0][0].float()
    start = plan.vocoder_from * per_frame
    piece = wave[plan.sent - start: plan.cut - start].clone()
    tail = job.tail.to(piece.device, piece.dtype)
    blend = min(tail.numel(), piece.numel())
    if blend:
        ramp = crossfade_ramp(blend, piece.device, piece.dtype)
        piece[:blend] = tail[:blend] * (1 - ramp) + piece[:blend] * ramp
    keep = plan.upto - plan.sent
    return piece[:keep], piece[keep:]


def run_chunks(s3gen: S3Gen, jobs: list[ChunkJob], tails: StreamTails) -> list[torch.Tensor]:
    """Each job's samples to send (float32, before watermarking); the tails are updated."""
    mels = solve_windows(s3gen, jobs)
    pieces = []
    for job, mel in zip(jobs, mels):
        piece, tail = vocode_window(s3gen, job, mel)
        if job.plan.final:
            tails.drop(job.key)
        else:
            tails.put(job.key, tail)
        pieces.append(piece)
    return pieces
