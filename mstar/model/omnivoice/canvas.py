"""A batch of OmniVoice requests laid out as one canvas, and the denoise loop over it.

Request ``i`` of ``B`` owns two canvas rows: row ``i`` (conditional: prompt ids, then any
reference audio codes, then its ``T_i`` target frames) and row ``B + i`` (unconditional: the
target frames alone, from position 0). Rows are padded with the mask id to the longest
conditional row. A row attends within its own real positions only; a padding position of an
unconditional row attends to itself alone and one of a conditional row to nothing (its output is
zeros and never read). This padded layout is the reference's; ``packed_logits`` gives the
same logits without padding (what the served engine runs: bit-identical whatever the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.schedule import UnmaskKnobs, unmask_counts, unmask_step


@dataclass
class CanvasPrompt:
    """One request's conditional row: ``ids [C, L]`` whose last ``target_len`` columns are the
    (masked) target and whose positions from ``audio_start`` on are audio."""

    ids: torch.Tensor
    audio_start: int
    target_len: int

    def __post_init__(self) -> None:
        length = self.ids.shape[-1]
        if not 0 < self.target_len <= length - self.audio_start <= length:
            raise ValueError(f"bad canvas prompt: length {length}, audio from "
                             f"{self.audio_start}, target {self.target_len}")


@dataclass
class Canvas:
    """The ``2B`` rows of a batch: ids ``[2B, C, L]``, audio flags ``[2B, L]``, mask
    ``[2B, 1, L, L]``, and each request's conditional length."""

    ids: torch.Tensor
    audio_mask: torch.Tensor
    attention_mask: torch.Tensor
    cond_lens: list[int]
    target_lens: list[int]

    @classmethod
    def build(cls, prompts: list[CanvasPrompt], mask_id: int,
              device: torch.device | str = "cpu") -> Canvas:
        batch, rows = len(prompts), prompts[0].ids.shape[0]
        length = max(p.ids.shape[-1] for p in prompts)
        ids = torch.full((2 * batch, rows, length), mask_id, dtype=torch.long, device=device)
        audio = torch.zeros(2 * batch, length, dtype=torch.bool, device=device)
        mask = torch.zeros(2 * batch, 1, length, length, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            c, t = p.ids.shape[-1], p.target_len
            ids[i, :, :c] = p.ids
            audio[i, p.audio_start:c] = True
            mask[i, :, :c, :c] = True
            ids[batch + i, :, :t] = p.ids[:, c - t:]
            audio[batch + i, :t] = True
            mask[batch + i, :, :t, :t] = True
            pad = torch.arange(t, length, device=device)
            mask[batch + i, :, pad, pad] = True
        return cls(ids, audio, mask, [p.ids.shape[-1] for p in prompts],
                   [p.target_len for p in prompts])

    @property
    def batch(self) -> int:
        return len(self.cond_lens)

    def target(self, i: int) -> torch.Tensor:
        """Request ``i``'s target ``[C, T]`` as it stands."""
        c, t = self.cond_lens[i], self.target_lens[i]
        return self.ids[i, :, c - t:c]

    def logits(self, i: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``i``'s conditional and unconditional target logits, each ``[C, T, V]``."""
        c, t = self.cond_lens[i], self.target_lens[i]
        return logits[i, :, c - t:c], logits[self.batch + i, :, :t]

    def write(self, i: int, target: torch.Tensor) -> None:
        """Put request ``i``'s updated target in both of its rows."""
        c, t = self.cond_lens[i], self.target_lens[i]
        self.ids[i, :, c - t:c] = target
        self.ids[self.batch + i, :, :t] = target


def packed_logits(backbone: OmniVoiceBackbone,
                  prompts: list[CanvasPrompt]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's conditional and unconditional target logits ``[C, T, V]`` from one packed
    forward (``OmniVoiceBackbone.forward_packed``: no padding, so batch-invariant)."""
    rows, masks = [], []
    for p in prompts:
        length = p.ids.shape[-1]
        rows.append(p.ids)
        masks.append(torch.arange(length, device=p.ids.device) >= p.audio_start)
    for p in prompts:
        rows.append(p.ids[:, -p.target_len:])
        masks.append(torch.ones(p.target_len, dtype=torch.bool, device=p.ids.device))
    logits = backbone.forward_packed(rows, masks)
    batch = len(prompts)
    return [(logits[i][:, -p.target_len:], logits[batch + i]) for i, p in enumerate(prompts)]


def denoise(backbone: OmniVoiceBackbone, canvas: Canvas, knobs: list[UnmaskKnobs],
            generators: list[torch.Generator | None], on_step=None) -> list[torch.Tensor]:
    """Run every request's unmasking schedule over the canvas; the final targets ``[C, T_i]``.

    Requests may ask for different step counts: the loop runs for the longest and a request
    whose schedule has ended keeps its target. ``on_step(step, canvas)`` (optional) sees the
    canvas after each step."""
    config = backbone.config
    counts = [unmask_counts(config.num_audio_codebook * t, k.num_step, k.t_shift)
              for t, k in zip(canvas.target_lens, knobs)]
    for step in range(max(k.num_step for k in knobs)):
        logits = backbone(canvas.ids, canvas.audio_mask, canvas.attention_mask)
        for i in range(canvas.batch):
            if step >= len(counts[i]) or counts[i][step] <= 0:
                continue
            cond, uncond = canvas.logits(i, logits)
            target = unmask_step(canvas.target(i), cond, uncond, counts[i][step], knobs[i],
                                 config.audio_mask_id, generators[i])
            canvas.write(i, target)
        if on_step is not None:
            on_step(step, canvas)
    return [canvas.target(i).clone() for i in range(canvas.batch)]
