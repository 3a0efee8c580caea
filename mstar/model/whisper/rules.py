"""Whisper's token rules for the autoregressive engine: forced task tokens, language detection,
tokens text never contains, and each sequence's scores (``TokenScores``): the log probability
of its text tokens and the probability that its audio holds no speech."""

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
    no_speech: int | None = None  # <|nospeech|>: its probability after SOT is scored


@dataclass
class WhisperState:
    detect: bool  # the prompt ends at SOT: the first token is the detected language
    task: str  # "transcribe" or "translate"
    text_start: int  # tokens generated before the text (language, task and no-timestamps)
    forced: list[int] = field(default_factory=list)  # the next tokens, decided already


class TokenScores:
    """Each sequence's scores as a row of one device table ``[slots, 1 + max_len]``, written
    where the tokens are chosen, so the host reads nothing per token: column 0 the probability
    of <|nospeech|> at its first step (softmax of the raw logits, as OpenAI's ``decode`` takes it
    at the position of SOT), column ``1 + p`` the log probability of its ``p``-th generated token
    under the logits it was chosen from, suppressed tokens removed (``log_softmax`` before the
    temperature: the reference's ``sum_logprobs``). A token's column is written, not added to,
    so a step launched ahead and discarded, or run again after a preemption, leaves no trace.
    ``summary`` reads a row once, as its sequence stops. Slots are taken at a sequence's first
    step and given back by ``drop``; the table doubles when it runs out."""

    def __init__(self, max_len: int, device: torch.device) -> None:
        self.table = torch.zeros(8, 1 + max_len, device=device)
        self.device = device
        self.slots: dict[str, int] = {}
        self._free = list(range(7, -1, -1))

    def write(self, seqs: list[Sequence], lead: int, logprobs: torch.Tensor,
              no_speech: tuple[list[int], torch.Tensor]) -> None:
        """``logprobs [B]``: each row's chosen token (at position ``generated + lead``);
        ``no_speech``: the rows taking their first step and their probability of no speech."""
        slots = [self._slot(seq.request_id) for seq in seqs]
        columns = [1 + seq.generated + lead for seq in seqs]
        first, probs = no_speech
        if first:
            slots, columns = slots + [slots[row] for row in first], columns + [0] * len(first)
            logprobs = torch.cat([logprobs, probs])
        where = to_device(torch.tensor([slots, columns], dtype=torch.int64), self.device)
        self.table.index_put_((where[0], where[1]), logprobs)

    def summary(self, seq: Sequence, text_start: int, tokens: int) -> torch.Tensor:
        """``[avg_logprob, no_speech_prob]`` of a stopped sequence (on the device) whose text
        tokens are the generated ones from ``text_start``, ``tokens`` of them before its end:
        OpenAI's average, the sum over the text tokens and the end-of-text token (when there is
        one) divided by ``tokens + 1``."""
        row = self.table[self.slots[seq.request_id]]
        total = row[1 + text_start:1 + seq.generated].sum()
        return torch.stack([total / (tokens + 1), row[0]])

    def drop(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _slot(self, request_id: str) -> int:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self._free:
                grown = self.table.shape[0]
                self.table = torch.cat([self.table, torch.zeros_like(self.table)])
                self._free = list(range(2 * grown - 1, grown - 1, -1))
            slot = self.slots[request_id] = self._free.pop()
            self.table[slot, 0] = 0.0
        return slot


class WhisperRules(TokenRules):
    """Request params they read: ``forced_ids`` (the tokens after SOT when the request names
    them: language, task, no-timestamps), ``detect_language`` (pick the language token, then
    force the task and no-timestamps tokens) and ``task`` ("transcribe" or "translate").

    Each row's next id: a pending forced token; at a detecting sequence's first step the
    likeliest language (then the task and no-timestamps tokens are forced); else the sampler's
    pick from the logits with the suppressed tokens at -inf. Host work is one pass over the
    rows' state; the rows are gathered and scattered by a few batched ops, on the device. A
    sequence with a forced token pending never runs ahead (the host decides that token); a
    language is detected at a request's first step, its prefill, which is never launched
    ahead.

    Every step also scores its rows on the device (``TokenScores``), and a sequence's last step
    writes ``scores``: ``[avg_logprob, no_speech_prob]``. The no-speech probability is taken at
    the first step, so a prompt that ends at SOT (as ``Whisper.window_request`` sends it) scores
    it where OpenAI's reference does."""

    extra_outputs = True  # ``scores`` as a sequence stops

    def __init__(self, tokens: DecoderTokens, device: torch.device, max_len: int = 448) -> None:
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
        self.scores = TokenScores(max_len, device)

    def start(self, params: dict) -> WhisperState:
        detect = bool(params.get("detect_language"))
        forced = [int(t) for t in params.get("forced_ids", ())]
        return WhisperState(detect=detect, task=params.get("task", "transcribe"),
                            text_start=len(forced) + (3 if detect else 0), forced=forced)

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
        no_speech = self.no_speech_prob(logits, seqs, lead)
        if not forced and not detect:
            masked = self.suppressed(logits, seqs, lead)
            ids = sample(masked, seqs)
            self.scores.write(seqs, lead, _logprob_of(masked, ids), no_speech)
            return ids
        taken = {row for row, _ in forced} | set(detect)
        sampled = [row for row in range(len(seqs)) if row not in taken]
        order = [row for row, _ in forced] + detect + sampled
        index = to_device(torch.tensor([token for _, token in forced] + order, dtype=torch.int64), self.device)
        forced_ids, rows = index[:len(forced)], index[len(forced):]
        parts = [forced_ids]
        logprobs = [torch.zeros(len(taken), device=logits.device)]  # not text: never summed
        if detect:
            scores = logits[rows[len(forced):len(forced) + len(detect)]][:, self.language_ids]
            parts.append(self.language_ids[scores.argmax(-1)])
        if sampled:
            chosen = [seqs[row] for row in sampled]
            masked = self.suppressed(logits[rows[len(forced) + len(detect):]], chosen)
            parts.append(sample(masked, chosen))
            logprobs.append(_logprob_of(masked, parts[-1]))
        ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        ids.index_copy_(0, rows, torch.cat(parts))
        row_logprobs = torch.empty(len(seqs), device=logits.device).index_copy_(0, rows, torch.cat(logprobs))
        self.scores.write(seqs, lead, row_logprobs, no_speech)
        return ids

    def no_speech_prob(self, logits: torch.Tensor, seqs: list[Sequence], lead: int) -> tuple[list[int], torch.Tensor]:
        """The rows taking their first step, and their probability of <|nospeech|> (softmax of
        the raw logits over the whole vocabulary)."""
        first = [row for row, seq in enumerate(seqs) if seq.generated == 0]
        if self.tokens.no_speech is None or lead or not first:
            return [], logits.new_zeros(0)
        rows = logits if len(first) == len(seqs) else logits[to_device(torch.tensor(first), self.device)]
        return first, rows.softmax(-1)[:, self.tokens.no_speech]

    def may_run_ahead(self, seq: Sequence) -> bool:
        return not seq.state.forced

    def last_outputs(self, seq: Sequence) -> dict[str, torch.Tensor]:
        state: WhisperState = seq.state
        text = seq.tokens[seq.prompt_len + state.text_start:]
        tokens = len(text) - (1 if text and text[-1] == self.tokens.eot else 0)
        return {"scores": self.scores.summary(seq, state.text_start, max(tokens, 0))}

    def release(self, request_id: str) -> None:
        self.scores.drop(request_id)

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


def _logprob_of(masked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's log probability of its id under ``masked`` (``[B, V]`` logits)."""
    return masked.log_softmax(-1).gather(1, ids.view(-1, 1)).view(-1)
