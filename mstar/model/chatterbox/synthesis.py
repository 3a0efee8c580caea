"""Chatterbox's two ends around T3: a reference clip to a ``Voice`` (API-server side), and
T3's speech tokens to marked 24 kHz audio (the ``s3gen`` node).

``clip_voice`` is the reference's ``prepare_conditionals``: the clip at 24 kHz (its first 10 s)
gives S3Gen's prompt mel, and at 16 kHz its S3 tokens and CAMPPlus x-vector (``embed_ref``);
at 16 kHz it also gives T3's prompt tokens (the first 6 s, Turbo's 15 s, at most
``speech_cond_prompt_len`` tokens) and the voice encoder's speaker embedding. Resampling uses
our polyphase filter where the reference uses librosa's and torchaudio's, so a cloned voice is
close to, not bit-equal with, the reference's; Turbo's reference also normalises the clip's
loudness to -27 LUFS first (pyloudnorm), which is not done here.

The multilingual reference keeps ids past S3's 6561 codes, which S3Gen cannot embed; they are
dropped here (where the reference would fail).

``s3gen_fn`` runs S3Gen per request: T3's tokens as the variant hands them on
(``speech_tokens_for_s3gen``), ``token2wav`` with a generator seeded by the request's seed
(the flow's noise, then the vocoder source's draws, in the reference's order), then PerTh.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.audio.io import resample
from mstar.contract import RequestError
from mstar.engine.base import EngineItem
from mstar.model.chatterbox.checkpoint import ClipEncoders, Voice
from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.streaming import ChunkJob, StreamTails, plan_chunk, run_chunks
from mstar.model.chatterbox.t3_decode import speech_tokens_for_s3gen
from mstar.model.perth import PerthWatermarker
from mstar.model.s3gen import S3Gen, S3GenPrompt, log_mel

__all__ = ["S3GEN_RATE", "S3_RATE", "clip_voice", "s3gen_fn", "vocode"]

S3GEN_RATE = 24000
S3_RATE = 16000
DECODER_SECONDS = 10  # the reference's DEC_COND_LEN: S3Gen's prompt
ENCODER_SECONDS = {"turbo": 15}  # ENC_COND_LEN: T3's prompt tokens (6 s but on Turbo)
MIN_SECONDS = {"turbo": 5.0}  # Turbo's reference refuses shorter clips
MIN_SAMPLES_16K = 4000  # 0.25 s: the voice encoder and CAMPPlus need a few frames


@torch.no_grad()
def clip_voice(encoders: ClipEncoders, samples: np.ndarray, sample_rate: int, config: T3Config) -> Voice:
    """The ``Voice`` of one reference clip (mono float32 at ``sample_rate``)."""
    seconds = samples.size / sample_rate
    least = MIN_SECONDS.get(config.variant, 0.0)
    if seconds <= least:
        raise RequestError("ref_audio", f"the clip is {seconds:.1f} s; Chatterbox {config.variant} "
                           f"needs over {least:g} s")
    wave24 = resample(samples.astype(np.float32), sample_rate, S3GEN_RATE)
    wave16 = resample(wave24, S3GEN_RATE, S3_RATE)
    if wave16.size < MIN_SAMPLES_16K:
        raise RequestError("ref_audio", f"the clip is {seconds:.2f} s; Chatterbox needs at least 0.25 s")
    prompt24 = torch.from_numpy(wave24[: DECODER_SECONDS * S3GEN_RATE].copy())
    prompt16 = torch.from_numpy(resample(prompt24.numpy(), S3GEN_RATE, S3_RATE))
    mel = log_mel(prompt24[None]).transpose(1, 2)  # [1, T, 80]
    s3_tokens, counts = encoders.tokenizer([prompt16])
    xvector = encoders.campplus([prompt16])
    prompt = S3GenPrompt.aligned(s3_tokens[:, : int(counts[0])], mel, xvector)
    whole16 = torch.from_numpy(wave16)
    head = whole16[: ENCODER_SECONDS.get(config.variant, 6) * S3_RATE]
    t3_tokens, t3_counts = encoders.tokenizer([head], max_tokens=config.speech_cond_prompt_len)
    speaker = encoders.voice_encoder([whole16])
    return Voice(speaker, t3_tokens[:, : int(t3_counts[0])], prompt)


@torch.no_grad()
def vocode(s3gen: S3Gen, config: T3Config, tokens: list[int], prompt: S3GenPrompt, seed: int,
           watermarker: PerthWatermarker | None) -> torch.Tensor:
    """One request's audio ``[samples]`` (float32, CPU) from all of T3's tokens."""
    device = s3gen.fade.device
    speech = _speech(s3gen, config, tokens, True)
    if not speech:
        return torch.zeros(0)
    generator = torch.Generator(device).manual_seed(seed)
    prompt = S3GenPrompt(prompt.tokens.to(device), prompt.mel.to(device, s3gen.fade.dtype),
                         prompt.xvector.to(device, s3gen.fade.dtype))
    wave = s3gen.token2wav(torch.tensor([speech], device=device), prompt, generator=generator)[0].float()
    if watermarker is not None:
        wave = watermarker.apply(wave, S3GEN_RATE)
    return wave.cpu()


def _speech(s3gen: S3Gen, config: T3Config, tokens: list[int], final: bool) -> list[int]:
    """The S3 tokens S3Gen reads of T3's ``tokens`` so far; before the end, without the
    silence Turbo appends to a finished utterance."""
    speech = [t for t in speech_tokens_for_s3gen(tokens, config) if t < s3gen.config.front.vocab_size]
    return speech[:-3] if config.is_gpt2 and not final else speech


def _job(s3gen: S3Gen, config: T3Config, item: EngineItem, prompt: S3GenPrompt, tails: StreamTails,
         context: int) -> ChunkJob | None:
    """A streamed chunk's ``ChunkJob`` (None: no speech yet). The fixed noise field is drawn
    first from the request's seeded generator, the vocoder's source draws follow it."""
    device, dtype = s3gen.fade.device, s3gen.fade.dtype
    tokens = [int(t) for t in item.inputs["token"].reshape(-1)]
    final = bool(item.chunk.last)
    speech = _speech(s3gen, config, tokens, final)
    done = len(_speech(s3gen, config, tokens[: item.chunk.keep_start], False)) if item.chunk.keep_start else 0
    tail = tails.get(item.request_id) if item.chunk.index else torch.zeros(0)
    plan = plan_chunk(len(speech), done, final, context, s3gen.held_frames,
                      s3gen.config.vocoder.samples_per_frame, s3gen.config.encoder.upsample)
    if not speech or plan.frames_end <= 2 * plan.window:
        return None
    generator = torch.Generator(device).manual_seed(int(item.params["seed"]))
    frames = s3gen.config.encoder.upsample * (prompt.tokens.shape[1] + int(item.params["max_new_tokens"]) + 3)
    field = torch.randn(1, s3gen.config.front.mel_channels, frames, generator=generator, device=device, dtype=dtype)
    prompt = S3GenPrompt(prompt.tokens.to(device), prompt.mel.to(device, dtype), prompt.xvector.to(device, dtype))
    return ChunkJob(item.request_id, speech, prompt, field, plan, tail, generator)


def _marked(piece: torch.Tensor, watermarker: PerthWatermarker | None) -> torch.Tensor:
    """A streamed piece, watermarked on its own (where marking is on), on the CPU."""
    if watermarker is not None and piece.numel() > 0:
        piece = watermarker.apply(piece, S3GEN_RATE)
    return piece.cpu()


def s3gen_fn(s3gen: S3Gen, config: T3Config, watermarker: PerthWatermarker | None, context: int = 0):
    """The ``s3gen`` node: each item is one chunk of a request's ``token`` stream (all its
    tokens so far), with the voice's prompt and params ``seed``, ``watermark``,
    ``max_new_tokens``. A chunk that is its stream's first and last is a whole utterance
    (``vocode``, the reference path); the others are streamed chunks (``streaming``), whose
    flow solves the step shares; ``context`` bounds their flow's left context."""
    tails = StreamTails()

    @torch.no_grad()
    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        audio: list[torch.Tensor] = [torch.zeros(0)] * len(items)
        jobs: list[tuple[int, ChunkJob]] = []
        for i, item in enumerate(items):
            prompt = S3GenPrompt(item.inputs["s3_tokens"].long(), item.inputs["s3_mel"], item.inputs["xvector"])
            marker = watermarker if item.params.get("watermark", True) else None
            chunk = item.chunk
            if chunk is None or (chunk.index == 0 and chunk.last):
                tokens = [int(t) for t in item.inputs["token"].reshape(-1)]
                audio[i] = vocode(s3gen, config, tokens, prompt, int(item.params["seed"]), marker)
            elif (job := _job(s3gen, config, item, prompt, tails, context)) is not None:
                jobs.append((i, job))
            elif chunk.last:  # nothing new: send what the tail kept
                audio[i] = _marked(tails.get(item.request_id), marker)
                tails.drop(item.request_id)
        for (i, _), piece in zip(jobs, run_chunks(s3gen, [job for _, job in jobs], tails)):
            marker = watermarker if items[i].params.get("watermark", True) else None
            audio[i] = _marked(piece, marker)
        return [{"audio": piece} for piece in audio]

    return run
