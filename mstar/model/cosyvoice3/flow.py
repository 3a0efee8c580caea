"""CosyVoice3's flow module around the DiT (the reference's ``CausalMaskedDiffWithDiT``): speech
tokens to mel frames.

The prompt's speech tokens and the new ones are embedded as one sequence; a pre-lookahead layer
(a convolution over each token and the ``lookahead`` tokens after it, leaky ReLU, then a causal
kernel-3 convolution back to the mel width, plus the input) mixes in a little right context;
each token's output is repeated ``token_mel_ratio`` times, one per mel frame. That is ``mu``:
there is no conformer encoder in CosyVoice3. The conditioning stack holds ``mu``, the speaker
vector (the x-vector L2-normalised, then projected to the mel width) and the prompt's own mel
over the prompt's frames. The DiT then samples mel for every frame with guided Euler steps
(``mstar.model.flow.solve_euler``) from the causal sampler's fixed noise table, and the frames
after the prompt are returned.

Streaming: a call that is not the last (``finalize=False``) treats its last ``lookahead``
tokens as context only: they feed the lookahead convolution of the tokens before them but get
no frames themselves. With ``streaming=True`` (chunked attention) and chunks aligned to
``static_chunk_size`` from the start of the prompt, the frames of each decoded prefix equal
those of the whole decode, which is how the reference streams (``stream_schedule``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.cosyvoice3.dit import DiTConfig, DiTEstimator
from mstar.model.flow.cfm import noise_table, solve_euler
from mstar.model.flow.estimator import FlowEstimator

__all__ = ["CosyVoice3Flow", "FlowConfig", "PreLookahead", "StreamChunk", "StreamPlanner", "stream_schedule"]


@dataclass(frozen=True)
class FlowConfig:
    """The defaults are Fun-CosyVoice3-0.5B's ``flow`` section (``cosyvoice3.yaml``)."""

    vocab_size: int = 6561
    mel_channels: int = 80  # also the token embedding width (input_size)
    speaker_dim: int = 192
    lookahead: int = 3  # pre_lookahead_len
    lookahead_channels: int = 1024
    token_mel_ratio: int = 2
    num_steps: int = 10
    cfg_rate: float = 0.7
    dit: DiTConfig = field(default_factory=DiTConfig)

    def __post_init__(self) -> None:
        if self.dit.mel_channels != self.mel_channels or self.dit.mu_channels != self.mel_channels:
            raise ValueError("the DiT's mel_channels and mu_channels must equal the flow's mel_channels")
        if self.dit.speaker_channels != self.mel_channels:
            raise ValueError("the DiT's speaker_channels must equal the flow's mel_channels (spk_emb_dim)")


class PreLookahead(nn.Module):
    """``[B, L, C]`` -> ``[B, L, C]``: each token sees itself and the ``lookahead`` tokens after
    it (zeros past the end, or the ``context`` tokens given), then two tokens before it."""

    def __init__(self, channels: int, hidden: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, tokens: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        h = tokens.transpose(1, 2)
        if context is not None:
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.pad(h, (0, tokens.shape[1] + self.lookahead - h.shape[2]))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + tokens


class CosyVoice3Flow(nn.Module):
    """``estimator``: the DiT, made by the caller when it is to run in another dtype than the
    rest of the flow (``checkpoint.build_flow``); by default made here like the rest."""

    def __init__(self, config: FlowConfig = FlowConfig(), estimator: DiTEstimator | None = None) -> None:
        super().__init__()
        self.config = config
        c = config
        if estimator is not None and estimator.config != c.dit:
            raise ValueError("the estimator's DiTConfig is not the flow config's dit")
        self.token_embedding = nn.Embedding(c.vocab_size, c.mel_channels)
        self.speaker_proj = nn.Linear(c.speaker_dim, c.mel_channels)
        self.lookahead = PreLookahead(c.mel_channels, c.lookahead_channels, c.lookahead)
        self.estimator = estimator if estimator is not None else DiTEstimator(c.dit)
        # drawn from a CPU generator, then placed where the module is being made
        noise = noise_table(c.mel_channels).to(torch.get_default_device(), torch.get_default_dtype())
        self.register_buffer("noise", noise, persistent=False)

    def token_features(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """``mu`` ``[B, mel, frames]`` of speech tokens ``[B, L]`` (prompt tokens first): all
        ``L`` tokens when ``finalize``, else the first ``L - lookahead`` with the rest as context."""
        emb = self.token_embedding(tokens.clamp(min=0))
        if finalize:
            h = self.lookahead(emb)
        else:
            cut = tokens.shape[1] - self.config.lookahead
            h = self.lookahead(emb[:, :cut], context=emb[:, cut:])
        return h.repeat_interleave(self.config.token_mel_ratio, dim=1).transpose(1, 2)

    def conditioning(self, mu: torch.Tensor, xvector: torch.Tensor, prompt_mel: torch.Tensor) -> torch.Tensor:
        """The DiT's stack ``[B, 3 * mel, frames]`` (prompt mel ``[B, T_prompt, mel]``)."""
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_mel.shape[1]] = prompt_mel.transpose(1, 2).to(mu.dtype)
        spks = self.speaker_proj(F.normalize(xvector, dim=1)).to(mu.dtype)
        return FlowEstimator.conditioning(mu, spks, cond)

    def forward(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                xvector: torch.Tensor, streaming: bool = False, finalize: bool = True,
                temperature: float = 1.0) -> torch.Tensor:
        """Mel ``[B, mel, frames]`` of the new ``tokens`` ``[B, L]`` after the prompt's
        ``prompt_tokens`` ``[B, L_p]``, whose mel ``[B, 2 * L_p, mel]`` and speaker x-vector
        ``[B, speaker_dim]`` condition the decode. Rows share their lengths."""
        c = self.config
        mu = self.token_features(torch.cat([prompt_tokens, tokens], dim=1), finalize)
        stack = self.conditioning(mu, xvector, prompt_mel)
        frames = mu.shape[-1]
        if frames > self.noise.shape[-1]:
            raise ValueError(f"{frames} mel frames: the noise table holds {self.noise.shape[-1]}")
        noise = (self.noise[:, :, :frames] * temperature).to(mu.dtype).expand(mu.shape[0], -1, -1)
        mask = mu.new_ones(mu.shape[0], 1, frames)
        mel = solve_euler(self.velocity, noise, mask, stack, c.num_steps, c.cfg_rate, streaming=streaming)
        return mel[:, :, prompt_mel.shape[1]:].float()

    def velocity(self, x: torch.Tensor, mask: torch.Tensor, cond_stack: torch.Tensor, t: torch.Tensor,
                 streaming: bool = False) -> torch.Tensor:
        """The DiT's velocity in ``x``'s dtype, the DiT run in its own (a bfloat16 DiT in a
        float32 flow, ``checkpoint.build_flow``: the Euler state and the conditioning keep
        float32, each call casts the inputs to the DiT's dtype and the velocity back)."""
        dtype = self.estimator.input_proj.weight.dtype
        if dtype == x.dtype:
            return self.estimator(x, mask, cond_stack, t, streaming=streaming)
        return self.estimator(x.to(dtype), mask.to(dtype), cond_stack.to(dtype), t.to(dtype),
                              streaming=streaming).to(x.dtype)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed flow call: decode the first ``tokens`` generated speech tokens (the last
    ``lookahead`` of them context only unless ``finalize``) and keep the mel frames from token
    ``offset`` on."""

    tokens: int
    offset: int
    finalize: bool


@dataclass
class StreamPlanner:
    """When to run the flow on a growing token stream, as the reference's driver decides: the
    first hop is padded so that prompt and first hop end on an attention-chunk boundary, each
    later hop is ``scale`` times the last up to ``max_hop``, a call waits for ``lookahead``
    tokens past its hop, and the last call takes what is left. (The reference keeps the grown
    hop on its model object, so its later requests start at ``max_hop``; each planner starts
    afresh.)"""

    prompt_tokens: int
    lookahead: int = 3
    hop: int = 25
    max_hop: int = 100
    scale: int = 2
    offset: int = 0

    def next_chunk(self, available: int, finished: bool) -> StreamChunk | None:
        """The call to make with ``available`` tokens generated (``finished``: the LM has
        stopped), or None to wait for more. After a final chunk, None."""
        if self.offset < 0:
            return None
        this_hop = self.hop + (-self.prompt_tokens % self.hop if self.offset == 0 else 0)
        if available - self.offset >= this_hop + self.lookahead:
            chunk = StreamChunk(tokens=self.offset + this_hop + self.lookahead, offset=self.offset, finalize=False)
            self.offset += this_hop
            self.hop = min(self.max_hop, self.hop * self.scale)
            return chunk
        if finished:
            chunk = StreamChunk(tokens=available, offset=self.offset, finalize=True)
            self.offset = -1
            return chunk
        return None


def stream_schedule(total: int, prompt_tokens: int, lookahead: int = 3, hop: int = 25, max_hop: int = 100,
                    scale: int = 2) -> Iterator[StreamChunk]:
    """Every call ``StreamPlanner`` makes for ``total`` tokens all known at once."""
    planner = StreamPlanner(prompt_tokens, lookahead, hop, max_hop, scale)
    while (chunk := planner.next_chunk(total, finished=True)) is not None:
        yield chunk
