"""OmniVoice's deployment knobs and a speech request's options (``model_kwargs``)."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Knobs, RequestKnobs
from mstar.model.omnivoice.schedule import UnmaskKnobs
from mstar.model.voice_cloning import ConditioningCacheKnobs

__all__ = ["OmniVoiceGenerateKnobs", "OmniVoiceKnobs", "OmniVoiceSpeechKnobs"]


class OmniVoiceKnobs(ConditioningCacheKnobs, Knobs):
    num_step: int = Field(32, ge=1, le=256)
    """Unmasking steps (backbone forwards) per request, the reference's default 32."""

    guidance_scale: float = Field(2.0, ge=0.0)
    """Classifier-free guidance between the prompted and the target-only canvas rows (0: off)."""

    t_shift: float = Field(0.1, gt=0.0)
    """Warp of the unmasking schedule; below 1 reveals few cells early and many late."""

    layer_penalty_factor: float = Field(5.0, ge=0.0)
    """Score taken off per codebook row, so the coarse rows are revealed first."""

    position_temperature: float = Field(5.0, ge=0.0)
    """Gumbel noise on which cells to reveal (0: the most confident ones, deterministic)."""

    class_temperature: float = Field(0.0, ge=0.0)
    """Gumbel sampling of the revealed ids among the top 10 % (0: argmax)."""

    denoise: bool = True
    """Put ``<|denoise|>`` in a cloning prompt (the reference's default): a cleaner voice."""

    max_seconds: float = Field(30.0, gt=0.0, le=120.0)
    """The longest speech one request may ask for (the canvas grows with it; the reference
    generates above 30 s in chunks, which this port does not)."""

    max_batch_size: int = Field(16, ge=1)
    """Requests in one canvas forward (each takes two rows: prompted and target-only)."""

    voices_dir: str | None = None
    """Preset voices: ``<name>.wav`` (or .flac, .ogg, .mp3) with its transcript in
    ``<name>.txt`` (required), each a ``voice`` cloned as an uploaded clip is."""

    def unmask(self, num_step: int | None = None, guidance_scale: float | None = None) -> UnmaskKnobs:
        return UnmaskKnobs(num_step=num_step or self.num_step,
                           guidance_scale=self.guidance_scale if guidance_scale is None else guidance_scale,
                           t_shift=self.t_shift, layer_penalty_factor=self.layer_penalty_factor,
                           position_temperature=self.position_temperature,
                           class_temperature=self.class_temperature)


class OmniVoiceSpeechKnobs(RequestKnobs):
    """A speech request's ``model_kwargs``."""

    language: str | None = Field(None, max_length=64)
    """The language to speak: a name (``Vietnamese``) or the model's id (``vi``); an unknown one
    warns and falls back to language-agnostic speech."""

    seed: int | None = Field(None, ge=0)
    """Seeds the unmasking noise (unset: fresh randomness)."""

    num_step: int | None = Field(None, ge=1, le=256)
    """Unmasking steps for this request (default: the deployment's ``num_step``)."""

    guidance_scale: float | None = Field(None, ge=0.0, le=20.0)
    """Guidance for this request (default: the deployment's)."""


class OmniVoiceGenerateKnobs(OmniVoiceSpeechKnobs):
    """``/generate``'s ``model_kwargs``: a speech request's plus ``speed``."""

    speed: float = Field(1.0, ge=0.25, le=4.0)
