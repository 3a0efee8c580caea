"""S3Gen's token-to-waveform decoder (Chatterbox's ``S3Token2Wav``): speech tokens and a voice
prompt -> mel frames -> 24 kHz audio.

A decode, as the reference runs it (``S3Token2Wav.inference``, batch of one, non-streaming):

1. the prompt's speech tokens and the new ones, concatenated, are embedded and encoded by the
   upsampling conformer (two frames per token);
2. the flow front builds the estimator's conditioning stack: the projected frames, the speaker
   vector (the x-vector normalised and projected) and the prompt's mel over the prompt's
   frames;
3. the causal CFM estimator (full attention: S3Gen runs no chunk mask) is integrated from
   Gaussian noise over ``n_cfm_timesteps`` (10) cosine-spaced Euler steps with classifier-free
   guidance (``cfg_rate`` 0.7), and the prompt's frames are dropped;
4. the HiFT vocoder with the per-sample sine source turns the mel into audio, and the first
   40 ms are faded in (20 ms of silence, then a 20 ms raised cosine) to hide what leaks over
   from the prompt clip.

Randomness: the reference draws the flow's noise from torch's global generator for every
call (``randn_like`` over prompt and new frames), then the vocoder source's phases and noise.
``token2wav`` takes one ``torch.Generator`` and draws the same values in the same order, so a
generator seeded like the reference's global one gives its audio sample for sample. A caller
that wants the causal samplers' fixed noise passes ``noise`` itself (``mstar.model.flow
.noise_table``).

The prompt (``S3GenPrompt``) comes from the reference clip: its mel (``log_mel``, two frames per
token), its speech tokens (the S3 tokenizer, 25 per second) and the CAMPPlus x-vector; the
tokenizer and the speaker encoder are separate components.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from mstar.model.flow import EstimatorConfig, FlowEstimator, FlowFront, FlowFrontConfig, solve_euler
from mstar.model.s3gen.encoder import EncoderConfig, UpsampleConformerEncoder
from mstar.model.s3gen.meanflow import solve_meanflow
from mstar.model.vocoder import HiFTConfig, HiFTGenerator

__all__ = ["S3Gen", "S3GenConfig", "S3GenPrompt", "fade_in"]


@dataclass(frozen=True)
class S3GenConfig:
    """The defaults are the released S3Gen's (``ResembleAI/chatterbox``'s ``s3gen.safetensors``)."""

    front: FlowFrontConfig = field(default_factory=FlowFrontConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    vocoder: HiFTConfig = field(default_factory=lambda: HiFTConfig(per_sample_source=True))
    n_cfm_timesteps: int = 10
    cfg_rate: float = 0.7
    fade_samples: int = 480  # 20 ms of silence, then 20 ms of fade-in, at 24 kHz

    def __post_init__(self) -> None:
        if self.front.token_dim != self.encoder.width or self.front.encoder_dim != self.encoder.width:
            raise ValueError(f"the flow front's token_dim and encoder_dim ({self.front.token_dim}, "
                             f"{self.front.encoder_dim}) must be the encoder's width {self.encoder.width}")
        if self.front.mel_channels != self.estimator.mel_channels or \
                self.estimator.cond_channels != 3 * self.front.mel_channels:
            raise ValueError("the estimator's mel_channels and cond_channels (3 x mel) must match the flow front's")
        if self.vocoder.in_channels != self.front.mel_channels:
            raise ValueError("the vocoder's in_channels must be the flow front's mel_channels")

    @classmethod
    def turbo(cls) -> S3GenConfig:
        """Chatterbox Turbo's S3Gen (``s3gen_meanflow.safetensors``): the same modules, a
        mean-flow estimator, two unguided steps."""
        return cls(estimator=EstimatorConfig(meanflow=True), n_cfm_timesteps=2)

    @property
    def meanflow(self) -> bool:
        return self.estimator.meanflow


@dataclass(frozen=True)
class S3GenPrompt:
    """A voice prompt: the clip's speech tokens ``[1, L]`` (long), its mel ``[1, T, mel]``
    (frames first, ``T = 2 L`` for a clip of whole 40 ms tokens) and its x-vector ``[1,
    speaker_dim]``. Row counts of 1 broadcast over a batch of new tokens."""

    tokens: torch.Tensor
    mel: torch.Tensor
    xvector: torch.Tensor

    @classmethod
    def aligned(cls, tokens: torch.Tensor, mel: torch.Tensor, xvector: torch.Tensor, ratio: int = 2) -> S3GenPrompt:
        """The prompt with tokens past ``mel frames // ratio`` dropped, as the reference's
        ``embed_ref`` does when the clip is not a whole number of tokens long."""
        return cls(tokens[:, : mel.shape[1] // ratio], mel, xvector)


def fade_in(samples: int) -> torch.Tensor:
    """``2 * samples`` gains: ``samples`` zeros, then a raised cosine from 0 to 1."""
    ramp = (torch.cos(torch.linspace(math.pi, 0, samples)) + 1) / 2
    return torch.cat([torch.zeros(samples), ramp])


def _rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    return x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 else x


class S3Gen(nn.Module):
    """Token encoder, flow front, CFM estimator and HiFT vocoder. Names follow the released
    checkpoint through ``s3gen_name_map`` (``flow.`` -> ``front``/``encoder``/``estimator``,
    ``mel2wav.`` -> ``vocoder``)."""

    def __init__(self, config: S3GenConfig = S3GenConfig()) -> None:
        super().__init__()
        self.config = config
        self.front = FlowFront(config.front)
        self.encoder = UpsampleConformerEncoder(config.encoder)
        self.estimator = FlowEstimator(config.estimator)
        self.vocoder = HiFTGenerator(config.vocoder)
        self.register_buffer("fade", fade_in(config.fade_samples), persistent=False)

    @property
    def held_frames(self) -> int:
        """Frames a non-final decode holds back: those of the last ``lookahead`` tokens, whose
        encoding still lacks the tokens the look-ahead conv reads."""
        return self.config.encoder.lookahead * self.config.encoder.upsample

    def noise_frames(self, tokens: torch.Tensor, prompt: S3GenPrompt, finalize: bool = True) -> int:
        """Frames the flow integrates for ``tokens`` after ``prompt``: prompt and new speech."""
        frames = (prompt.tokens.shape[1] + tokens.shape[1]) * self.config.encoder.upsample
        return frames if finalize else frames - self.held_frames

    def draw_noise(self, tokens: torch.Tensor, prompt: S3GenPrompt,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """The flow's starting noise ``[B, mel, noise_frames]`` as the reference draws it: one
        field over prompt and new frames; Turbo first draws the new frames' noise, then the
        whole field, and keeps the field's draws for the prompt's frames only."""
        b, mel = tokens.shape[0], self.config.front.mel_channels
        frames = self.noise_frames(tokens, prompt)
        new = tokens.shape[1] * self.config.encoder.upsample

        def draw(n: int) -> torch.Tensor:
            return torch.randn(b, mel, n, generator=generator, device=tokens.device, dtype=self.fade.dtype)

        if not self.config.meanflow:
            return draw(frames)
        head = draw(new)
        field = draw(frames)
        field[..., frames - new:] = head
        return field

    def conditioning(self, tokens: torch.Tensor, prompt: S3GenPrompt, token_lengths: torch.Tensor | None = None,
                     finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator's conditioning stack ``[B, 3 * mel, T]`` and frame mask ``[B, 1, T]``
        for new ``tokens`` ``[B, L]`` (``token_lengths``: valid tokens per row, default all).
        A padded row's valid frames are those of its solo decode (``solo_rows``).
        ``finalize=False`` (the stream goes on): the last ``held_frames`` are left out."""
        b = tokens.shape[0]
        prompt_tokens = _rows(prompt.tokens, b).to(tokens.device)
        lengths = torch.full((b,), tokens.shape[1], device=tokens.device) if token_lengths is None else token_lengths
        lengths = lengths + prompt_tokens.shape[1]
        embedded = self.front.embed_tokens(torch.cat([prompt_tokens, tokens.to(prompt_tokens.dtype)], dim=1), lengths)
        encoded, frame_lengths = self.encoder(embedded, lengths, solo_rows=True)
        if not finalize:
            encoded, frame_lengths = encoded[:, : -self.held_frames], frame_lengths - self.held_frames
        stack = self.front.conditioning(encoded, _rows(prompt.xvector, b), _rows(prompt.mel, b).to(encoded.dtype))
        mask = (torch.arange(encoded.shape[1], device=encoded.device)[None] < frame_lengths[:, None])[:, None]
        return stack, mask.to(encoded.dtype)

    def token2mel(self, tokens: torch.Tensor, prompt: S3GenPrompt, noise: torch.Tensor, *,
                  token_lengths: torch.Tensor | None = None, n_cfm_timesteps: int | None = None,
                  cfg_rate: float | None = None, finalize: bool = True) -> torch.Tensor:
        """The mel ``[B, mel, 2 L]`` of new ``tokens`` ``[B, L]`` from ``noise`` ``[B, mel,
        noise_frames]`` (prompt frames first; they are integrated and then dropped). With
        ``token_lengths``, a row's first ``2 * length`` frames are its solo decode's from the
        same noise prefix; the frames after them are padding.

        ``finalize=False`` decodes a stream's tokens so far without the frames of its last
        ``lookahead`` tokens (``held_frames``): ``2 L - held_frames`` frames from noise of
        ``noise_frames(..., finalize=False)``. This is what the reference's ``finalize=False``
        means to do (cut the encoder's output); chatterbox 0.1.7 fails there (its mask keeps
        the uncut length), so this path has no reference to match."""
        stack, mask = self.conditioning(tokens, prompt, token_lengths, finalize)
        if noise.shape[-1] != stack.shape[-1]:
            raise ValueError(f"noise has {noise.shape[-1]} frames, the decode integrates {stack.shape[-1]}")
        steps = n_cfm_timesteps or self.config.n_cfm_timesteps
        if self.config.meanflow:
            if cfg_rate:
                raise ValueError("the meanflow sampler runs without guidance: cfg_rate must be None or 0")
            mel = solve_meanflow(self.estimator, noise.to(stack.dtype), mask, stack, num_steps=steps)
        else:
            mel = solve_euler(self.estimator, noise.to(stack.dtype), mask, stack, num_steps=steps,
                              cfg_rate=self.config.cfg_rate if cfg_rate is None else cfg_rate)
        return FlowFront.new_frames(mel, prompt.mel)

    def mel2wav(self, mel: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Mel ``[B, mel, T]`` -> audio ``[B, T * samples_per_frame]``, its head faded in."""
        wave, _ = self.vocoder(mel, generator=generator)
        head = min(wave.shape[-1], self.fade.shape[0])
        return torch.cat([wave[:, :head] * self.fade[:head].to(wave.dtype), wave[:, head:]], dim=1)

    @torch.no_grad()
    def token2wav(self, tokens: torch.Tensor, prompt: S3GenPrompt, *, generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None, n_cfm_timesteps: int | None = None) -> torch.Tensor:
        """New speech ``tokens`` ``[B, L]`` in ``prompt``'s voice -> 24 kHz audio ``[B, 2 L *
        samples_per_frame]``. Without ``noise``, the flow's starting noise is drawn from
        ``generator`` first, then the vocoder's source draws from it (the reference's order)."""
        if noise is None:
            noise = self.draw_noise(tokens, prompt, generator)
        mel = self.token2mel(tokens, prompt, noise, n_cfm_timesteps=n_cfm_timesteps)
        return self.mel2wav(mel, generator)
