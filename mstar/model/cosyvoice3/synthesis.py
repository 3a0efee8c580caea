"""CosyVoice3's whole walk in plain Python, one request at a time: speech tokens from the LM,
mel chunks from the flow as the tokens arrive, waveform from the causal HiFT.

This is the eager reference of the family's path (the served graph batches the same steps
across requests): ``speech_tokens`` runs the LM over a private paged KV cache with
repetition-aware sampling; ``stream_audio`` follows the reference's streaming driver
(``CosyVoice3Model.tts`` with ``stream=True``): each time ``StreamPlanner`` says so, the flow
decodes every token so far with chunked attention and the new frames are appended to the mel;
the causal HiFT then decodes the whole mel so far (``finalize=False`` until the end) and the
samples past those already sent are emitted. Both halves only ever extend what they sent, so
the joined stream equals ``whole_audio`` (the flow with chunked attention, then HiFT, over all
tokens at once).

The voice prompt (``VoicePrompt``) comes from the front ends: the reference clip's transcript
tokens, its speech tokens (S3 tokenizer, 25 per second), its 24 kHz log-mel (two frames per
token) and its CAM++ x-vector.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.model.cosyvoice3.flow import CosyVoice3Flow, StreamPlanner
from mstar.model.cosyvoice3.lm import SpeechLM, length_bounds
from mstar.model.cosyvoice3.sampling import RasParams, sample_speech_token
from mstar.model.vocoder import HiFTGenerator

__all__ = ["SILENT_TOKENS", "VoicePrompt", "speech_tokens", "stream_audio", "whole_audio"]

SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
"""The speech tokens of silence and breath (CosyVoice3's driver: at most five in a row reach the flow)."""


@dataclass(frozen=True)
class VoicePrompt:
    """The cloned voice: ``text_ids`` [L] (its transcript's tokens, ending the instruction
    with ``<|endofprompt|>``), ``speech`` [N] (its speech tokens), ``mel`` [2N, mel] and
    ``xvector`` [speaker_dim]."""

    text_ids: torch.Tensor
    speech: torch.Tensor
    mel: torch.Tensor
    xvector: torch.Tensor

    def __post_init__(self) -> None:
        if self.mel.shape[0] != 2 * self.speech.shape[0]:
            raise ValueError(f"prompt mel has {self.mel.shape[0]} frames for {self.speech.shape[0]} speech tokens "
                             "(two frames a token expected)")


def _one_sequence_step(start: int, count: int, page_size: int, device: torch.device) -> PagedAttentionMetadata:
    """Metadata of a step adding ``count`` tokens at ``start`` to the only sequence, whose
    pages are ``0, 1, 2, ...``."""
    end = start + count
    positions = torch.arange(start, end, device=device)
    pages = -(-end // page_size)
    return PagedAttentionMetadata(positions=positions, slot_mapping=positions.clone(),
                                  query_start_loc=torch.tensor([0, count], device=device),
                                  seq_lens=torch.tensor([end], device=device),
                                  page_table=torch.arange(pages, device=device)[None], page_size=page_size,
                                  host_query_start_loc=(0, count), host_seq_lens=(end,))


@torch.no_grad()
def speech_tokens(lm: SpeechLM, text_ids: torch.Tensor, prompt: VoicePrompt, generator: torch.Generator,
                  params: RasParams | None = None, page_size: int = 16,
                  silent: frozenset[int] = SILENT_TOKENS, max_silent_run: int = 5) -> Iterator[int]:
    """The speech tokens of ``text_ids`` (the text to speak, without the prompt's transcript)
    in the prompt's voice, as they are sampled. Stop tokens are banned until the minimum length
    (every stop id: the reference bans only id ``speech_token_size``, which in CosyVoice3's
    layout is ``sos``, not ``eos``); decoding ends at a stop token or the maximum length. Runs
    of silent tokens past ``max_silent_run`` are sampled and fed back but not yielded."""
    config, params = lm.config, params or RasParams()
    min_len, max_len = length_bounds(config, len(text_ids))
    device = lm.speech_embedding.weight.device
    ids = lm.prompt_ids(torch.cat([prompt.text_ids, text_ids]).to(device), prompt.speech.to(device))
    capacity = ids.shape[0] + max_len
    layers, kv_heads, head_dim = lm.cache_shape()
    caches = allocate_kv_cache(layers, -(-capacity // page_size), page_size, kv_heads, head_dim,
                               lm.speech_embedding.weight.dtype, device)
    history: list[int] = []
    length, silent_run = 0, 0
    for step in range(max_len):
        meta = _one_sequence_step(length, ids.shape[0], page_size, device)
        length += ids.shape[0]
        logp = lm.compute_logits(lm(ids, meta, caches)[-1:]).float().log_softmax(-1)[0]
        token = sample_speech_token(logp, history, params, generator,
                                    banned=config.stop_ids if step < min_len else ())
        if token in config.stop_ids:
            return
        history.append(token)
        silent_run = silent_run + 1 if token in silent else 0
        if silent_run <= max_silent_run:
            yield token
        ids = torch.tensor([token], device=device)


def _flow_call(flow: CosyVoice3Flow, tokens: list[int], prompt: VoicePrompt, finalize: bool) -> torch.Tensor:
    device = flow.token_embedding.weight.device
    return flow(torch.tensor([tokens], device=device), prompt.speech[None].to(device), prompt.mel[None].to(device),
                prompt.xvector[None].to(device), streaming=True, finalize=finalize)


@torch.no_grad()
def stream_audio(flow: CosyVoice3Flow, hift: HiFTGenerator, tokens: Iterable[int], prompt: VoicePrompt,
                 planner: StreamPlanner | None = None) -> Iterator[torch.Tensor]:
    """Waveform pieces ``[samples]`` of the speech ``tokens`` as they arrive; joined, they are
    ``whole_audio`` of all the tokens. ``planner`` (default: the released hops) decides when
    the flow runs."""
    planner = planner or StreamPlanner(prompt_tokens=prompt.speech.shape[0], lookahead=flow.config.lookahead)
    received: list[int] = []
    mel: torch.Tensor | None = None
    sent = 0

    def run(chunk) -> torch.Tensor:
        nonlocal mel, sent
        new = _flow_call(flow, received[:chunk.tokens], prompt, chunk.finalize)
        new = new[..., chunk.offset * flow.config.token_mel_ratio:]
        mel = new if mel is None else torch.cat([mel, new], dim=-1)
        wave, _ = hift(mel, finalize=chunk.finalize)
        piece = wave[0, sent:]
        sent += piece.shape[0]
        return piece

    for token in tokens:
        received.append(token)
        while (chunk := planner.next_chunk(len(received), finished=False)) is not None:
            yield run(chunk)
    while (chunk := planner.next_chunk(len(received), finished=True)) is not None:
        yield run(chunk)


@torch.no_grad()
def whole_audio(flow: CosyVoice3Flow, hift: HiFTGenerator, tokens: list[int], prompt: VoicePrompt) -> torch.Tensor:
    """The waveform ``[samples]`` of all ``tokens`` at once (chunked attention, as streamed)."""
    wave, _ = hift(_flow_call(flow, tokens, prompt, finalize=True), finalize=True)
    return wave[0]
