"""Orpheus's engines: the Llama talker writes an audio code beside each audio token, and
the SNAC node decodes windows of those codes into 24 kHz audio."""

from __future__ import annotations

from collections import defaultdict

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, Sequence
from mstar.engine.base import EngineItem
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


class OrpheusTalkerEngine(AutoregressiveEngine):
    """The Llama decoder; its ``code`` output carries the SNAC code of an audio token (the
    token's offset for its position in the frame removed) and stays silent otherwise, as
    the reference streaming decoder skips tokens that are not a valid code there.

    Request param ``audio_only`` (set by the deployment's benchmarking knob
    ``model_kwargs.benchmark_audio_only``): every token is sampled among the valid codes of
    its position in the frame, so each step yields one code however the weights look.
    """

    def _new_sequence(self, prompt: list[int], params: dict) -> Sequence:
        seq = super()._new_sequence(prompt, params)
        seq.extra["audio_only"] = bool(params.get("audio_only", False))
        return seq

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.choose_on_device(logits, seqs).tolist()

    def choose_on_device(self, logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
        """The sampler over the valid codes of each ``audio_only`` row's position; a step
        launched ahead (``lead`` 1) is one audio code further along than the host has seen
        (such a row's every token is a code)."""
        if any(seq.extra.get("audio_only") for seq in seqs):
            logits = restrict_to_audio_codes(logits, seqs, lead)
        return super().choose_on_device(logits, seqs, lead)

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        out = super().outputs(seq, token)
        if token == START_OF_SPEECH:  # speech (re)starts: frames count from here
            seq.extra["codes"] = 0
            return out
        count = seq.extra.get("codes", 0)
        if token < AUDIO_BASE:
            return out
        code = token - AUDIO_BASE - (count % TOKENS_PER_FRAME) * CODEBOOK
        if 0 <= code < CODEBOOK:
            seq.extra["codes"] = count + 1
            out["code"] = torch.tensor([code], dtype=torch.int64)
        return out


def restrict_to_audio_codes(logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
    """``logits [B, V]`` with every id outside the valid code range of the position ``lead``
    codes after the host's count set to -inf, for the rows whose sequence is ``audio_only``
    (other rows unchanged)."""
    vocab = logits.shape[-1]
    bounds = [audio_code_range(seq.extra.get("codes", 0) + lead) if seq.extra.get("audio_only") else (0, vocab)
              for seq in seqs]
    lo, hi = torch.tensor(bounds, dtype=torch.int64, device=logits.device).unbind(-1)
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
            codes = [codes_from_orpheus(items[i].inputs["codes"][: frames * TOKENS_PER_FRAME].tolist()) for i in indices]
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
