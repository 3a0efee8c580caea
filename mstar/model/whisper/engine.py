"""Whisper's engines: the batched audio encoder, and the decoder as an autoregressive engine
with a cross-attention KV written once per request and Whisper's token rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, Sequence
from mstar.engine.base import EngineItem
from mstar.layers.attention import PagedAttentionMetadata


def encoder_fn(model):
    """The encoder node: every window of the plan in one batched forward."""

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        dtype = next(model.parameters()).dtype
        mel = torch.stack([item.inputs["mel"].to(dtype) for item in items])
        features = model.encode(mel)
        return [{"audio_features": f} for f in features]

    return run


@dataclass(frozen=True)
class WhisperRules:
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


class WhisperDecoderEngine(AutoregressiveEngine):
    """Request params it reads besides the generic ones: ``detect_language`` (the prompt ends
    at SOT: pick the language token, then force the task and no-timestamps tokens) and
    ``task`` ("transcribe" or "translate")."""

    def __init__(self, model, rules: WhisperRules, **kwargs):
        super().__init__(model, **kwargs)
        self.rules = rules
        self.cross: dict[str, list] = {}
        mask = torch.zeros(rules.vocab_size, dtype=torch.bool)
        mask[list(rules.suppress)] = True
        mask[rules.sot:] = True  # special and timestamp tokens never appear in text
        self.suppress_mask = mask.to(self.device)
        self.begin_mask = mask.clone()
        self.begin_mask[list(rules.begin_suppress)] = True
        self.begin_mask = self.begin_mask.to(self.device)
        self.language_ids = torch.tensor(rules.language_ids, dtype=torch.int64, device=self.device)

    def forward(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, items: list[EngineItem]) -> torch.Tensor:
        for item in items:
            if item.op == "prefill":
                features = item.inputs["audio_features"]
                dtype = next(self.model.parameters()).dtype
                self.cross[item.request_id] = self.model.cross_kv(features.reshape(-1, features.shape[-1]).to(self.device, dtype))
        cross = [self.cross[item.request_id] for item in items]
        return self.model.decode(input_ids, meta, self.kv_caches, cross)

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float().clone()
        chosen: dict[int, int] = {}
        for row, seq in enumerate(seqs):
            state = seq.extra
            if state.get("forced"):
                chosen[row] = state["forced"].pop(0)
            elif state["detect"] and seq.generated == 0:
                lang = int(self.language_ids[logits[row, self.language_ids].argmax()])
                task = self.rules.translate if state.get("task") == "translate" else self.rules.transcribe
                state["forced"] = [task, self.rules.no_timestamps]
                chosen[row] = lang
            else:
                first_text = seq.generated == state.get("text_start", 0)
                mask = self.begin_mask if first_text else self.suppress_mask
                logits[row, mask] = float("-inf")
        sampled = [row for row in range(len(seqs)) if row not in chosen]
        if sampled:
            picks = super().choose(logits[sampled], [seqs[r] for r in sampled])
            chosen.update(zip(sampled, picks))
        return [chosen[row] for row in range(len(seqs))]

    def _new_sequence(self, prompt, params):
        seq = super()._new_sequence(prompt, params)
        detect = bool(params.get("detect_language"))
        seq.extra["detect"] = detect
        seq.extra["task"] = params.get("task", "transcribe")
        seq.extra["text_start"] = 3 if detect else 0  # language, task and no-timestamps come first
        return seq

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.cross.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return super().stats() | {"cross_kv_requests": len(self.cross)}
