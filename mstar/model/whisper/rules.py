"""Whisper's token rules for the autoregressive engine: forced task tokens, language detection,
and tokens text never contains."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import to_device


@dataclass(frozen=True)
class DecoderTokens:
    """Token ids the decoder needs beyond the model: what to suppress and what to detect."""

    vocab_size: int
    eot: int
    sot: int
    no_timestamps: int
    transcribe: int
    translate: int
    language_ids: tuple[int, ...]
    suppress: tuple[int, ...]  # never produced as text
    begin_suppress: tuple[int, ...]  # not as the first text token


@dataclass
class WhisperState:
    detect: bool  # the prompt ends at SOT: the first token is the detected language
    task: str  # "transcribe" or "translate"
    text_start: int  # tokens generated before the text (language, task and no-timestamps)
    forced: list[int] = field(default_factory=list)  # the next tokens, decided already


class WhisperRules(TokenRules):
    """Request params they read: ``detect_language`` (pick the language token, then force
    the task and no-timestamps tokens) and ``task`` ("transcribe" or "translate").

    Each row's next id: a pending forced token; at a detecting sequence's first step the
    likeliest language (then the task and no-timestamps tokens are forced); else the sampler's
    pick from the logits with the suppressed tokens at -inf. Host work is one pass over the
    rows' state; the rows are gathered and scattered by a few batched ops, on the device. A
    sequence with a forced token pending never runs ahead (the host decides that token); a
    language is detected at a request's first step, its prefill, which is never launched
    ahead."""

    def __init__(self, tokens: DecoderTokens, device: torch.device) -> None:
        self.tokens = tokens
        self.device = device
        mask = torch.zeros(tokens.vocab_size, dtype=torch.bool)
        mask[list(tokens.suppress)] = True
        mask[tokens.sot:] = True  # special and timestamp tokens never appear in text
        self.suppress_mask = mask.to(device)
        begin = mask.clone()
        begin[list(tokens.begin_suppress)] = True
        self.begin_mask = begin.to(device)
        self.language_ids = torch.tensor(tokens.language_ids, dtype=torch.int64, device=device)

    def start(self, params: dict) -> WhisperState:
        detect = bool(params.get("detect_language"))
        return WhisperState(detect=detect, task=params.get("task", "transcribe"), text_start=3 if detect else 0)

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        forced: list[tuple[int, int]] = []  # (row, id)
        detect: list[int] = []
        if not lead:
            for row, seq in enumerate(seqs):
                state: WhisperState = seq.state
                if state.forced:
                    forced.append((row, state.forced.pop(0)))
                elif state.detect and seq.generated == 0:
                    task = self.tokens.translate if state.task == "translate" else self.tokens.transcribe
                    state.forced = [task, self.tokens.no_timestamps]
                    detect.append(row)
        logits = logits.float()
        if not forced and not detect:
            return sample(self.suppressed(logits, seqs, lead), seqs)
        taken = {row for row, _ in forced} | set(detect)
        sampled = [row for row in range(len(seqs)) if row not in taken]
        order = [row for row, _ in forced] + detect + sampled
        index = to_device(torch.tensor([token for _, token in forced] + order, dtype=torch.int64), self.device)
        forced_ids, rows = index[:len(forced)], index[len(forced):]
        parts = [forced_ids]
        if detect:
            scores = logits[rows[len(forced):len(forced) + len(detect)]][:, self.language_ids]
            parts.append(self.language_ids[scores.argmax(-1)])
        if sampled:
            chosen = [seqs[row] for row in sampled]
            parts.append(sample(self.suppressed(logits[rows[len(forced) + len(detect):]], chosen), chosen))
        ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        return ids.index_copy_(0, rows, torch.cat(parts))

    def may_run_ahead(self, seq: Sequence) -> bool:
        return not seq.state.forced

    def suppressed(self, logits: torch.Tensor, seqs: list[Sequence], lead: int = 0) -> torch.Tensor:
        """``logits`` with the tokens no row may produce at -inf (the first text token of a
        sequence also avoids ``begin_suppress``): one masked fill for the batch. ``lead``: the
        rows choose the token ``lead`` places after their host state's next one."""
        first = [seq.generated + lead == seq.state.text_start for seq in seqs]
        if any(first):
            flags = to_device(torch.tensor(first), self.device).view(-1, 1)
            mask = torch.where(flags, self.begin_mask, self.suppress_mask)
        else:
            mask = self.suppress_mask
        return logits.masked_fill(mask, float("-inf"))
