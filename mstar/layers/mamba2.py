"""The Mamba-2 mixer (state-space duality, SSD) in pure PyTorch, with per-request state slots.

Per head ``h`` (of ``P`` channels) the layer keeps a ``[P, N]`` state ``S``. Token ``t``, with
its step ``dt_t > 0`` and the head's decay rate ``A_h < 0``, decays the state, writes its
input against its key ``B_t`` and reads it with its query ``C_t``:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T
    y_t = S_t C_t + D_h x_t

``B`` and ``C`` are shared by the ``H / G`` heads of a group. ``ssd_step`` runs the
recurrence for one token (decode). ``ssd_chunked`` (prefill) takes ``L`` tokens at a time:
with ``s_t`` the cumulative log decay ``sum dt A`` inside a chunk and ``S`` the state at its
start, a chunk's outputs are a masked, decayed attention plus a read of ``S``,

    y_t = sum_{j <= t} exp(s_t - s_j) (C_t . B_j) dt_j x_j  +  exp(s_t) S C_t

and the next chunk starts from ``exp(s_L) S + sum_j exp(s_L - s_j) dt_j x_j B_j^T``.

Before the scan, ``x``, ``B`` and ``C`` pass through a depthwise causal convolution (then
SiLU) whose window, the last ``kernel - 1`` inputs, is carried like the state. After it, the
output is gated and normed per group (``MambaRMSNormGated``: ``norm(y * silu(z))``). Both
states live in per-request slots (``mstar.engine.state_pool``); a step's ``StateBatch`` says
which slot each sequence uses. The one-token sequences of a step (decodes) run together
through ``ssd_step``; the longer ones (prefills, prefill chunks) run together through
``ssd_chunked``, padded to the longest at the end with ``dt = 0`` (no decay, no write, so the
padding leaves each final state as it was).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.gated_deltanet import StateBatch, causal_conv

CHUNK_SIZE = 128
CHUNKS_AT_ONCE = 16  # chunks whose [L, L] within-chunk terms are computed together


def _heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: head ``h`` reads group ``h // (H / G)``."""
    groups = t.shape[-2]
    if heads % groups:
        raise ValueError(f"{heads} heads is not a multiple of {groups} groups")
    return t.repeat_interleave(heads // groups, dim=-2)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence (no ``D`` skip): ``state [b, H, P, N]``, ``x [b, H, P]``,
    ``dt [b, H]`` (after softplus), ``A [H]``, ``B``/``C [b, G, N]``.

    Returns ``(y [b, H, P], new state [b, H, P, N])`` in float32."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    B, C = _heads_of_groups(B.float(), heads), _heads_of_groups(C.float(), heads)
    decay = torch.exp(dt * A.float())
    state = state.float() * decay[..., None, None] + (dt[..., None] * x)[..., :, None] * B[..., None, :]
    y = (state @ C[..., :, None])[..., 0]
    return y, state


def _pair_decay(steps: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` per-token log decays -> ``[..., L, L]`` with ``exp(s_i - s_j)`` at ``j <= i``
    and 0 above the diagonal. Each entry sums its own tokens' steps (``j < k <= i``) rather
    than subtracting two long cumulative sums, which would lose the small differences."""
    length = steps.shape[-1]
    after = torch.ones(length, length, dtype=torch.bool, device=steps.device).tril(-1)  # k > j
    sums = steps[..., :, None].expand(*steps.shape, length).masked_fill(~after, 0.0).cumsum(dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=steps.device).tril()
    return sums.masked_fill(~causal, float("-inf")).exp()


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                initial_state: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
                chunks_at_once: int = CHUNKS_AT_ONCE) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence ``chunk_size`` tokens at a time (no ``D`` skip): ``x [b, T, H, P]``,
    ``dt [b, T, H]`` (after softplus), ``A [H]``, ``B``/``C [b, T, G, N]``, ``initial_state
    [b, H, P, N]`` (zeros when absent).

    The within-chunk terms take ``[b, H, L, L]`` per chunk; ``chunks_at_once`` chunks are
    computed together, so a long prompt's transient memory stays bounded.

    Returns ``(y [b, T, H, P], final state [b, H, P, N])`` in float32."""
    batch, length, heads, head_dim = x.shape
    x, dt = x.float(), dt.float()
    B, C = _heads_of_groups(B.float(), heads), _heads_of_groups(C.float(), heads)
    state_size = B.shape[-1]
    if initial_state is None:
        state = x.new_zeros(batch, heads, head_dim, state_size)
    else:
        state = initial_state.float().clone()
    pad = -length % chunk_size
    if pad:  # dt = 0: padded tokens neither decay nor write the state
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_size

    def heads_first(t: torch.Tensor) -> torch.Tensor:  # [b, T, H, ...] -> [b, H, chunks, L, ...]
        t = t.reshape(batch, chunks, chunk_size, heads, -1)
        return t.permute(0, 3, 1, 2, 4)

    x, B, C = heads_first(x), heads_first(B), heads_first(C)
    dt = heads_first(dt)[..., 0]  # [b, H, chunks, L]
    steps = dt * A.float()[None, :, None, None]  # log decay of each token
    log_decay = steps.cumsum(dim=-1)  # s_t inside each chunk
    written = x * dt[..., None]  # dt_j x_j
    reads = C * log_decay.exp()[..., None]  # C_t exp(s_t): reads of the chunk-start state
    writes = written * (log_decay[..., -1:] - log_decay).exp()[..., None]  # decayed to the chunk end
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    y = torch.empty_like(x)
    for first in range(0, chunks, chunks_at_once):
        group = slice(first, min(first + chunks_at_once, chunks))
        # within-chunk terms: a decayed, causally masked attention of C over B
        y[:, :, group] = ((C[:, :, group] @ B[:, :, group].transpose(-1, -2)) * _pair_decay(steps[:, :, group])) \
            @ written[:, :, group]
        for c in range(group.start, group.stop):
            y[:, :, c] += reads[:, :, c] @ state.transpose(-1, -2)
            state = state * chunk_decay[:, :, c] + writes[:, :, c].transpose(-1, -2) @ B[:, :, c]
    y = y.permute(0, 2, 3, 1, 4).reshape(batch, chunks * chunk_size, heads, head_dim)
    return y[:, :length], state


class MambaRMSNormGated(nn.Module):
    """``weight * rmsnorm(y * silu(z))``, the RMS taken over groups of ``group_size``
    channels (one per ``n_groups``); float32 maths."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"{dim} channels do not split into groups of {group_size}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight.float() * grouped.view(h.shape)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 token mixer of Nemotron-H (parameter names are the checkpoint's).

    ``in_proj`` yields, per token, the gate ``z`` (``H * P``), the convolution's input
    ``xBC`` (``x``: ``H * P``, then ``B`` and ``C``: ``G * N`` each) and the raw step ``dt``
    (``H``); ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, ``A = -exp(A_log)``.
    (transformers clamps only in its chunked path; with the default limit ``(0, inf)`` both
    of its paths and ours agree.)
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, *, chunk_size: int = CHUNK_SIZE, use_bias: bool = False,
                 use_conv_bias: bool = True, eps: float = 1e-5,
                 time_step_limit: tuple[float, float] = (0.0, float("inf"))) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.chunk_size = chunk_size
        self.time_step_limit = tuple(time_step_limit)
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                bias=use_conv_bias, padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = MambaRMSNormGated(self.inner, self.inner // n_groups, eps)
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=use_bias)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes: the conv window ``[kernel - 1, conv_dim]`` and the SSM state
        ``[H, P, N]``."""
        return {"conv": (self.conv1d.kernel_size[0] - 1, self.conv_dim),
                "ssm": (self.num_heads, self.head_dim, self.state_size)}

    def forward(self, x: torch.Tensor, batch: StateBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` of a flattened step -> ``[T, hidden]``; reads and updates the
        slots named by ``batch`` in ``conv_state [slots, W, conv_dim]`` and ``ssm_state
        [slots, H, P, N]`` (in place)."""
        gate, xbc, dt = self.in_proj(x).split((self.inner, self.conv_dim, self.num_heads), dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        y = x.new_empty(x.shape[0], self.inner, dtype=torch.float32)
        if batch.single_rows.numel():
            rows = batch.single_rows
            y[rows] = self._decode(xbc[rows], dt[rows], batch.single_slots, conv_state, ssm_state)
        if batch.spans:
            spans = batch.spans
            longest = max(end - start for start, end, _ in spans)
            padded = xbc.new_zeros(len(spans), longest, self.conv_dim)
            padded_dt = dt.new_zeros(len(spans), longest, self.num_heads)
            for i, (start, end, _) in enumerate(spans):
                padded[i, :end - start], padded_dt[i, :end - start] = xbc[start:end], dt[start:end]
            lengths = torch.tensor([end - start for start, end, _ in spans], device=x.device)
            slots = torch.tensor([slot for _, _, slot in spans], dtype=torch.int64, device=x.device)
            out = self._prefill(padded, padded_dt, lengths, slots, conv_state, ssm_state)
            for i, (start, end, _) in enumerate(spans):
                y[start:end] = out[i, :end - start]
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    def _split(self, xbc: torch.Tensor):
        """The convolved ``xBC`` into ``x [..., H, P]``, ``B``, ``C [..., G, N]``."""
        xs, B, C = F.silu(xbc).split((self.inner, self.n_groups * self.state_size,
                                      self.n_groups * self.state_size), dim=-1)
        lead = xs.shape[:-1]
        return (xs.reshape(*lead, self.num_heads, self.head_dim),
                B.reshape(*lead, self.n_groups, self.state_size), C.reshape(*lead, self.n_groups, self.state_size))

    def _decode(self, xbc, dt, slots, conv_state, ssm_state) -> torch.Tensor:
        """One token for each of ``len(slots)`` sequences: ``[D, H * P]``."""
        conv, window = causal_conv(xbc[:, None], conv_state[slots], self.conv1d.weight[:, 0], self.conv1d.bias)
        conv_state[slots] = window.to(conv_state.dtype)
        xs, B, C = self._split(conv[:, 0])
        A = -self.A_log.float().exp()
        y, state = ssd_step(ssm_state[slots], xs, dt, A, B, C)
        ssm_state[slots] = state.to(ssm_state.dtype)
        return (y + self.D.float()[:, None] * xs.float()).flatten(1)

    def _prefill(self, xbc, dt, lengths, slots, conv_state, ssm_state) -> torch.Tensor:
        """Sequences padded at the end to ``[S, L, ...]`` (``dt`` zero past each length):
        ``[S, L, H * P]``; each slot's window is its sequence's last ``kernel - 1`` inputs."""
        window = conv_state[slots]
        width = window.shape[1]
        conv, _ = causal_conv(xbc, window, self.conv1d.weight[:, 0], self.conv1d.bias)
        full = torch.cat((window.to(xbc.dtype), xbc), dim=1)
        last = lengths[:, None] + torch.arange(width, device=xbc.device)  # rows of the last inputs in full
        conv_state[slots] = full[torch.arange(len(slots), device=xbc.device)[:, None], last].to(conv_state.dtype)
        xs, B, C = self._split(conv)
        A = -self.A_log.float().exp()
        y, state = ssd_chunked(xs, dt, A, B, C, ssm_state[slots], self.chunk_size)
        ssm_state[slots] = state.to(ssm_state.dtype)
        return (y + self.D.float()[:, None] * xs.float()).flatten(2)
