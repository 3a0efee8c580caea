"""Waypoint's world DiT: a rectified-flow transformer over latent frames, causal in frames.

Each frame is ``height x width`` tokens. A token attends to every token of its own frame and to
the kept past frames of its layer (``frame_visible``): a local layer the last ``local_window - 1``
frames, a global layer a longer window, optionally only every ``global_pinned_dilation``-th past
frame. Per frame, the noise level conditions every block through adaptive RMS norms and gates
(one conditioning vector per frame), and the frame's controller input (mouse velocity, pressed
buttons, scroll sign) is fused into its tokens by a two-layer MLP in the blocks that have one.
Rotary positions rotate a head's pairs by the token's column, row (a linear "pixel" spectrum
over [-1, 1]) and frame (a geometric spectrum).

``WorldDiT.forward`` takes ``N`` consecutive frames with a noise level and a control each, and
an optional ``FrameKV`` of earlier frames' keys and values: frame-by-frame generation (``N = 1``
over the cache) and one teacher-forced pass over many frames (``N > 1``, the equivalent mask)
are the same computation. Parameter names are those of Overworld's ``world_engine``
``WorldModel`` state dict, so its ``model.safetensors`` loads by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.waypoint.config import WaypointConfig


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def frame_visible(query: int, key: int, window: int, dilation: int) -> bool:
    """Whether a past frame ``key`` (< ``query``) is in frame ``query``'s view for a layer that
    keeps every ``dilation``-th frame in ``window`` slots (the query's own frame takes one)."""
    return key < query and key % dilation == 0 and key // dilation > query // dilation - window


class MLP(nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int):
        super().__init__()
        self.fc1 = nn.Linear(dim_in, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


def per_frame(x: torch.Tensor, frames: int) -> torch.Tensor:
    """``[B, N * T, D] -> [B, N, T, D]``."""
    return x.view(x.shape[0], frames, -1, x.shape[-1])


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """RMS-normalised tokens scaled and shifted by their frame's ``[B, N, D]`` vectors."""
    n = scale.shape[1]
    y = rms_norm(per_frame(x, n)) * (1 + scale[:, :, None]) + shift[:, :, None]
    return y.flatten(1, 2)


def gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (per_frame(x, g.shape[1]) * g[:, :, None]).flatten(1, 2)


class NoiseConditioner(nn.Module):
    """Noise level -> Fourier features of ``1000 sigma`` over a geometric spectrum -> MLP. The
    reference keeps this module in float32 whatever the model's dtype (the loader does too)."""

    def __init__(self, dim: int, fourier_dim: int = 512, base: float = 10_000.0):
        super().__init__()
        # computed in float32, then the model's dtype: what building in float32 and casting gave
        freq = torch.logspace(0, -1, fourier_dim // 2, base=base, dtype=torch.float32)
        self.register_buffer("freq", freq.to(torch.get_default_dtype()), persistent=False)
        self.mlp = MLP(fourier_dim, 4 * dim, dim)

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        phase = (sigma.float() * 1000)[..., None] * self.freq
        features = torch.cat((phase.sin(), phase.cos()), dim=-1) * math.sqrt(2)
        return self.mlp(features.to(self.mlp.fc1.weight.dtype))


class ControlEmbedding(nn.Module):
    """A frame's control ``[mouse x, mouse y, buttons..., scroll]`` -> one ``d_model`` vector."""

    def __init__(self, config: WaypointConfig):
        super().__init__()
        self.mlp = MLP(config.control_dim, config.d_model * config.mlp_ratio, config.d_model)

    def forward(self, control: torch.Tensor) -> torch.Tensor:
        return self.mlp(control)


class ControlFusion(nn.Module):
    """``fc2(silu(fc1([token, control])))``: ``fc1``'s first half reads the token, its second
    half the frame's control, so the control's half is computed once per frame."""

    def __init__(self, config: WaypointConfig):
        super().__init__()
        d = config.d_model
        self.mlp = MLP(2 * d, d, d)

    def forward(self, x: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
        w_token, w_control = self.mlp.fc1.weight.chunk(2, dim=1)
        h = F.linear(per_frame(x, control.shape[1]), w_token) + F.linear(control, w_control)[:, :, None]
        return self.mlp.fc2(F.silu(h)).flatten(1, 2)


class CondHead(nn.Module):
    """Modulation vectors from the frame's conditioning: six (scale, shift, gate for attention,
    then for the MLP), or three when a block has one head per branch."""

    def __init__(self, config: WaypointConfig, n: int = 6):
        super().__init__()
        d = config.d_model
        self.bias_in = nn.Parameter(torch.zeros(d)) if config.noise_conditioning == "wan" else None
        self.cond_proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n))

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = F.silu(cond + self.bias_in if self.bias_in is not None else cond)
        return tuple(proj(h) for proj in self.cond_proj)


class FrameRotary(nn.Module):
    """Angles of a token at (frame, row, column): columns and rows take an eighth of the head's
    width each (linear spectrum up to 0.4 x the shorter side, over positions in [-1, 1]), frames
    a quarter (geometric spectrum, base 10000); each frequency turns two adjacent pairs."""

    def __init__(self, config: WaypointConfig):
        super().__init__()
        self.height, self.width = config.height, config.width
        head = config.head_dim
        max_freq = min(self.height, self.width) * 0.8
        # computed in float32, then the model's dtype: what building in float32 and casting gave
        pixel_freq = torch.linspace(1.0, max_freq / 2, head // 16, dtype=torch.float32) * math.pi
        self.register_buffer("pixel_freq", pixel_freq.to(torch.get_default_dtype()), persistent=False)
        time_dim = head // 4
        time_freq = 1.0 / 10_000 ** (torch.arange(0, time_dim, 2).float() / time_dim)
        self.register_buffer("time_freq", time_freq.to(torch.get_default_dtype()), persistent=False)

    def angles(self, frames: torch.Tensor) -> torch.Tensor:
        """``[N * height * width, head_dim / 2]`` angles for frames ``frames [N]``."""
        h, w = self.height, self.width
        cols = torch.linspace(-1 + 1 / w, 1 - 1 / w, w, device=frames.device)
        rows = torch.linspace(-1 + 1 / h, 1 - 1 / h, h, device=frames.device)
        ax = (cols[:, None] * self.pixel_freq).repeat_interleave(2, -1)[None, :].expand(h, w, -1)
        ay = (rows[:, None] * self.pixel_freq).repeat_interleave(2, -1)[:, None].expand(h, w, -1)
        at = (frames.float()[:, None] * self.time_freq).repeat_interleave(2, -1)
        n = frames.shape[0]
        space = torch.cat((ax, ay), -1).reshape(1, h * w, -1).expand(n, -1, -1)
        time = at[:, None].expand(-1, h * w, -1)
        return torch.cat((space, time), -1).reshape(n * h * w, -1)

    @staticmethod
    def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Pairs ``(x[2i], x[2i+1])`` turned by ``angles[i]``; the results laid out as all first
        members, then all second members (the same layout for queries and keys)."""
        x0, x1 = x.float()[..., 0::2], x.float()[..., 1::2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).to(x.dtype)


class FrameKV:
    """Keys and values of past frames, per layer: ``{frame: (k, v)}``, each ``[B, kv_heads,
    tokens_per_frame, head_dim]``, written by the clean pass of each frame and dropped once no
    later frame can see them. Part of a rollout's state (``mstar.model.waypoint.rollout``)."""

    def __init__(self, config: WaypointConfig):
        self.windows = [config.window(i) for i in range(config.n_layers)]
        self.layers: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.n_layers)]

    def visible(self, layer: int, query_frames: list[int]) -> list[int]:
        """The cached frames some frame of ``query_frames`` sees, in order."""
        window, dilation = self.windows[layer]
        return [f for f in sorted(self.layers[layer])
                if any(frame_visible(q, f, window, dilation) for q in query_frames)]

    def write(self, layer: int, frames: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        tokens = k.shape[2] // len(frames)
        window, dilation = self.windows[layer]
        store = self.layers[layer]
        for i, frame in enumerate(frames):
            if frame % dilation == 0:
                store[frame] = (k[:, :, i * tokens:(i + 1) * tokens], v[:, :, i * tokens:(i + 1) * tokens])
        future = frames[-1] + 1  # the earliest later frame sees the most: what it cannot see, none can
        for frame in [f for f in store if not frame_visible(future, f, window, dilation)]:
            del store[frame]

    def frames(self) -> int:
        return sum(len(layer) for layer in self.layers)


class Attention(nn.Module):
    def __init__(self, config: WaypointConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.window, self.dilation = config.window(layer)
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        d = config.d_model
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.v_lamb = nn.Parameter(torch.tensor(0.5)) if config.value_residual else None
        self.gate_proj = nn.Linear(self.n_heads, self.n_heads, bias=False) if config.gated_attn else None

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def forward(self, x, angles, frames: list[int], first_v, cache: FrameKV | None, persist: bool):
        q = self.heads(self.q_proj(x), self.n_heads)
        k = self.heads(self.k_proj(x), self.kv_heads)
        v = self.heads(self.v_proj(x), self.kv_heads)
        if self.v_lamb is not None:
            first_v = v if first_v is None else first_v
            v = torch.lerp(v, first_v, self.v_lamb)
        q = FrameRotary.rotate(rms_norm(q), angles)
        k = FrameRotary.rotate(rms_norm(k), angles)

        past = cache.visible(self.layer, frames) if cache is not None else []
        key_frames = past + frames
        keys = torch.cat([cache.layers[self.layer][f][0] for f in past] + [k], 2)
        values = torch.cat([cache.layers[self.layer][f][1] for f in past] + [v], 2)
        mask = self.mask(frames, key_frames, k.shape[2] // len(frames), x.device)
        if cache is not None and persist:
            cache.write(self.layer, frames, k, v)
        if self.kv_heads != self.n_heads:
            keys = keys.repeat_interleave(self.n_heads // self.kv_heads, 1)
            values = values.repeat_interleave(self.n_heads // self.kv_heads, 1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        if self.gate_proj is not None:
            gates = torch.sigmoid(self.gate_proj(x[..., :self.n_heads]))  # [B, T, heads]
            y = y * gates.transpose(1, 2)[..., None]
        return self.out_proj(y.transpose(1, 2).flatten(2)), first_v

    def mask(self, frames: list[int], key_frames: list[int], tokens: int, device) -> torch.Tensor | None:
        """``[N * T, K * T]`` boolean: own frame, or a past frame in view; None when all true."""
        allowed = torch.tensor([[q == f or frame_visible(q, f, self.window, self.dilation) for f in key_frames]
                                for q in frames], dtype=torch.bool)
        if bool(allowed.all()):
            return None
        return allowed.repeat_interleave(tokens, 0).repeat_interleave(tokens, 1).to(device)


class WorldBlock(nn.Module):
    def __init__(self, config: WaypointConfig, layer: int):
        super().__init__()
        self.attn = Attention(config, layer)
        self.mlp = MLP(config.d_model, config.d_model * config.mlp_ratio, config.d_model)
        if config.split_cond_heads:
            self.attn_cond_head, self.mlp_cond_head = CondHead(config, 3), CondHead(config, 3)
        else:
            self.cond_head = CondHead(config)
        fuses = layer % config.ctrl_conditioning_period == 0
        self.ctrl_mlpfusion = ControlFusion(config) if fuses else None

    def forward(self, x, cond, control, angles, frames, first_v, cache, persist):
        if hasattr(self, "cond_head"):
            s0, b0, g0, s1, b1, g1 = self.cond_head(cond)
        else:
            (s0, b0, g0), (s1, b1, g1) = self.attn_cond_head(cond), self.mlp_cond_head(cond)
        y, first_v = self.attn(modulate(x, s0, b0), angles, frames, first_v, cache, persist)
        x = x + gate(y, g0)
        if self.ctrl_mlpfusion is not None:
            x = x + self.ctrl_mlpfusion(rms_norm(x), rms_norm(control))
        x = x + gate(self.mlp(modulate(x, s1, b1)), g1)
        return x, first_v


class Transformer(nn.Module):
    def __init__(self, config: WaypointConfig):
        super().__init__()
        self.blocks = nn.ModuleList(WorldBlock(config, i) for i in range(config.n_layers))


class OutNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.fc(F.silu(cond)).chunk(2, dim=-1)
        return modulate(x, scale, shift)


class WorldDiT(nn.Module):
    """Velocity of ``N`` latent frames at their noise levels, given their controls and the
    past in ``cache``."""

    def __init__(self, config: WaypointConfig):
        super().__init__()
        self.config = config
        self.denoise_step_emb = NoiseConditioner(config.d_model)
        self.ctrl_emb = ControlEmbedding(config)
        # The classifier-free-guidance null control of training; inference runs conditioned, but
        # the checkpoint carries it.
        self.ctrl_cfg = nn.Module() if config.ctrl_conditioning is not None else None
        if self.ctrl_cfg is not None:
            self.ctrl_cfg.null_emb = nn.Parameter(torch.zeros(1, 1, config.d_model))
        self.transformer = Transformer(config)
        if config.noise_conditioning in ("wan", "dit_air"):
            self._tie_conditioning()
        ph, pw = config.patch
        self.patchify = nn.Conv2d(config.channels, config.d_model, (ph, pw), (ph, pw), bias=False)
        self.unpatchify = nn.Linear(config.d_model, config.channels * ph * pw, bias=True)
        self.out_norm = OutNorm(config.d_model)
        self.rotary = FrameRotary(config)

    def _tie_conditioning(self) -> None:
        """Every block's conditioning projections are the first block's (only the input biases
        are per block), as the reference ties them: ~0.58B of the 1.86B untied parameters."""
        first = self.transformer.blocks[0]
        for block in self.transformer.blocks[1:]:
            for head in ("cond_head", "attn_cond_head", "mlp_cond_head"):
                if hasattr(block, head):
                    for mine, theirs in zip(getattr(block, head).cond_proj, getattr(first, head).cond_proj):
                        mine.weight = theirs.weight

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, first_frame: int, control: torch.Tensor,
                cache: FrameKV | None = None, persist: bool = False) -> torch.Tensor:
        """``x [B, N, C, H, W]`` frames ``first_frame ..``, ``sigma [B, N]``, ``control [B, N,
        control_dim]`` -> velocity ``[B, N, C, H, W]``. With ``persist`` the frames' keys and
        values go into ``cache`` for later frames (the clean pass of a generated frame)."""
        c = self.config
        b, n, ch, h, w = x.shape
        ph, pw = c.patch
        if (h // ph, w // pw) != (c.height, c.width) or h % ph or w % pw:
            raise ValueError(f"latent frames of {h}x{w} do not make the DiT's {c.height}x{c.width} token grid")
        frames = list(range(first_frame, first_frame + n))
        angles = self.rotary.angles(torch.tensor(frames, device=x.device))
        cond = self.denoise_step_emb(sigma).to(self.unpatchify.weight.dtype)
        ctrl = self.ctrl_emb(control)
        tokens = self.patchify(x.reshape(b * n, ch, h, w)).flatten(2).transpose(1, 2)  # [B*N, T, D]
        tokens = tokens.reshape(b, n * c.tokens_per_frame, c.d_model)
        first_v = None
        for block in self.transformer.blocks:
            tokens, first_v = block(tokens, cond, ctrl, angles, frames, first_v, cache, persist)
        out = self.unpatchify(F.silu(self.out_norm(tokens, cond)))  # [B, N*T, C*ph*pw]
        out = out.view(b, n, c.height, c.width, ch, ph, pw).permute(0, 1, 4, 2, 5, 3, 6)
        return out.reshape(b, n, ch, h, w)
