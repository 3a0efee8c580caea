"""BAGEL's generation side: the modules around the LLM that turn VAE latents into LLM tokens and
LLM states into velocities, and the pure functions of its flow-matching loop.

An image of ``H x W`` pixels is ``h x w = H/16 x W/16`` tokens: its VAE latent ``[C, 2h, 2w]``
cut into 2x2 patches, each flattened ``(dy, dx, c)`` into ``4C`` values. A noisy token enters the
LLM (its generation weights) as ``vae2llm(x_t) + time_embedder(t) + latent_pos_embed(pos)``;
``llm2vae`` of its output state is the velocity ``v = noise - clean``. The loop walks ``t`` from 1
(noise) to 0 (image) over a shifted schedule, ``x <- x - v * dt``, with classifier-free guidance
over three contexts (full; without the text; without the input images) whose combined velocity
is rescaled towards the conditional one's norm (``cfg_renorm_type``).

Module and parameter names are the released checkpoint's keys (``time_embedder.mlp.0.weight``,
``vae2llm.weight``, ``llm2vae.bias``); ``latent_pos_embed.pos_embed``, a fixed table, is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mstar.model.bagel.vision import sincos_table

__all__ = [
    "CfgOptions",
    "LatentPositionEmbedding",
    "LatentProjections",
    "TimestepEmbedder",
    "cfg_active",
    "cfg_combine",
    "latent_grid",
    "latent_position_ids",
    "patchify_latent",
    "timestep_schedule",
    "unpatchify_latent",
]

FREQUENCY_DIM = 256  # width of the sinusoidal timestep features
CFG_RENORM_TYPES = ("global", "channel", "text_channel")


class TimestepEmbedder(nn.Module):
    """``t`` in ``[0, 1]`` -> ``[cos(t f_i), sin(t f_i)]`` (``f_i = 10000^(-i/128)``) -> MLP."""

    def __init__(self, hidden_size: int, frequency_dim: int = FREQUENCY_DIM) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if self.frequency_dim % 2:
            features = torch.cat([features, torch.zeros_like(features[:, :1])], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class LatentPositionEmbedding(nn.Module):
    """A latent token's 2D position (``row * max_latent_size + col``) -> a row of the fixed 2D
    sine-cosine table (``vision.sincos_table``), made here and never loaded: BAGEL never trains
    it, and a checkpoint's copy is skipped (``checkpoint.FIXED_TABLES``)."""

    def __init__(self, max_latent_size: int, hidden_size: int) -> None:
        super().__init__()
        self.max_latent_size = max_latent_size
        # float32 (from float64), then the model's dtype: what building in float32 and casting gave
        table = sincos_table(max_latent_size, hidden_size).to(torch.get_default_dtype())
        self.register_buffer("pos_embed", table, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[position_ids]


class LatentProjections(nn.Module):
    """The four generation modules, named as the checkpoint's top-level keys."""

    def __init__(self, hidden_size: int, latent_channels: int = 16, patch_size: int = 2,
                 max_latent_size: int = 64) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.latent_channels = latent_channels
        patch_dim = patch_size * patch_size * latent_channels
        self.time_embedder = TimestepEmbedder(hidden_size)
        self.vae2llm = nn.Linear(patch_dim, hidden_size)
        self.llm2vae = nn.Linear(hidden_size, patch_dim)
        self.latent_pos_embed = LatentPositionEmbedding(max_latent_size, hidden_size)

    def embed(self, x: torch.Tensor, t: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Latent tokens ``[N, 4C]`` at times ``t`` ``[N]`` and positions ``[N]`` -> LLM inputs."""
        return self.vae2llm(x) + self.time_embedder(t) + self.latent_pos_embed(position_ids)

    def velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LLM's output states of latent tokens -> their velocities ``[N, 4C]``."""
        return self.llm2vae(hidden)


# --------------------------------------------------------------------------- latent tokens


def latent_grid(height: int, width: int, downsample: int = 16) -> tuple[int, int]:
    """Token grid ``(h, w)`` of an ``height x width`` image (pixels per token side: VAE 8 x patch 2)."""
    return height // downsample, width // downsample


def patchify_latent(latent: torch.Tensor, h: int, w: int, patch_size: int = 2) -> torch.Tensor:
    """VAE latent ``[C, >= p*h, >= p*w]`` -> tokens ``[h * w, p * p * C]`` (row-major; values in
    ``(dy, dx, c)`` order). A latent larger than the grid (a padded batch) is cropped."""
    c, p = latent.shape[0], patch_size
    x = latent[:, : h * p, : w * p].reshape(c, h, p, w, p)
    return x.permute(1, 3, 2, 4, 0).reshape(h * w, p * p * c)


def unpatchify_latent(tokens: torch.Tensor, h: int, w: int, patch_size: int = 2) -> torch.Tensor:
    """Inverse of ``patchify_latent``: tokens ``[h * w, p * p * C]`` -> latent ``[C, p * h, p * w]``."""
    p = patch_size
    c = tokens.shape[-1] // (p * p)
    return tokens.reshape(h, w, p, p, c).permute(4, 0, 2, 1, 3).reshape(c, h * p, w * p)


def latent_position_ids(h: int, w: int, max_latent_size: int, interpolate: bool = False) -> torch.Tensor:
    """Flat positions ``[h * w]`` into the ``max_latent_size``-sided table: ``row * max + col``
    (BAGEL's default extrapolation), or with ``interpolate`` each axis spread over the table
    (fraction ``i / n`` into the bucket of ``max`` equal steps)."""
    if interpolate:
        rows, cols = (_bucket(n, max_latent_size) for n in (h, w))
    else:
        rows, cols = torch.arange(h), torch.arange(w)
    if int(rows.max()) >= max_latent_size or int(cols.max()) >= max_latent_size:
        raise ValueError(f"a {h}x{w} token grid exceeds the {max_latent_size}-sided position table")
    return (rows[:, None] * max_latent_size + cols[None]).flatten()


def _bucket(n: int, side: int) -> torch.Tensor:
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    return torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / n), boundaries, right=True)


# --------------------------------------------------------------------------- the loop's maths


def timestep_schedule(num_timesteps: int, shift: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, dt)``, each ``[num_timesteps - 1]``: ``num_timesteps`` points evenly from 1 to 0,
    shifted ``s t / (1 + (s - 1) t)``; step ``i`` evaluates at ``t[i]`` and moves by ``dt[i]``."""
    if num_timesteps < 2:
        raise ValueError(f"num_timesteps {num_timesteps} < 2: the schedule has no step")
    t = torch.linspace(1, 0, num_timesteps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


@dataclass(frozen=True)
class CfgOptions:
    """Classifier-free guidance of a generation (BAGEL's ``InterleaveInferencer`` defaults)."""

    text_scale: float = 4.0  # guidance of the text (contexts with vs without the text)
    img_scale: float = 1.5  # guidance of the input images (with vs without them); edits only
    interval: tuple[float, float] = (0.4, 1.0)  # guidance on where interval[0] < t <= interval[1]
    renorm_type: str = "global"  # "global", "channel" or "text_channel"
    renorm_min: float = 0.0  # lower clamp of the norm ratio

    def __post_init__(self) -> None:
        if self.renorm_type not in CFG_RENORM_TYPES:
            raise ValueError(f"cfg_renorm_type {self.renorm_type!r} is not one of {CFG_RENORM_TYPES}")


def cfg_active(t: float, interval: tuple[float, float]) -> bool:
    """Whether guidance applies at time ``t``: ``interval[0] < t <= interval[1]``."""
    return interval[0] < t <= interval[1]


def cfg_combine(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, text_scale: float,
                img_scale: float, renorm_type: str = "global", renorm_min: float = 0.0) -> torch.Tensor:
    """One image's guided velocity ``[N, 4C]`` from the full context's ``v``, the text-dropped
    ``v_text`` and the image-dropped ``v_img`` (each used when its scale exceeds 1).

    Text guidance ``v_text + s_t (v - v_text)``, then image guidance ``v_img + s_i (. - v_img)``,
    then a rescale by ``|v| / |guided|`` clamped to ``[renorm_min, 1]``: over the whole image
    (``global``), per token (``channel``), or, for ``text_channel``, per token on the text-guided
    velocity before image guidance (which is then left unscaled).
    """
    if text_scale <= 1.0:
        return v
    assert v_text is not None, "text guidance needs the text-dropped velocity"
    guided = v_text + text_scale * (v - v_text)
    if renorm_type == "text_channel":
        guided = guided * _norm_ratio(v, guided, -1, renorm_min)
        return v_img + img_scale * (guided - v_img) if img_scale > 1.0 else guided
    if img_scale > 1.0:
        assert v_img is not None, "image guidance needs the image-dropped velocity"
        guided = v_img + img_scale * (guided - v_img)
    if renorm_type == "global":
        return guided * _norm_ratio(v, guided, None, renorm_min)
    if renorm_type == "channel":
        return guided * _norm_ratio(v, guided, -1, renorm_min)
    raise ValueError(f"cfg_renorm_type {renorm_type!r} is not one of {CFG_RENORM_TYPES}")


def _norm_ratio(v: torch.Tensor, guided: torch.Tensor, dim: int | None, floor: float) -> torch.Tensor:
    if dim is None:
        ratio = torch.norm(v) / (torch.norm(guided) + 1e-8)
    else:
        ratio = torch.norm(v, dim=dim, keepdim=True) / (torch.norm(guided, dim=dim, keepdim=True) + 1e-8)
    return ratio.clamp(min=floor, max=1.0)
