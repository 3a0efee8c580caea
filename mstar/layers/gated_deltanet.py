"""Gated DeltaNet: linear attention with a gated delta-rule recurrent state (pure PyTorch).

Per value head the layer keeps a ``[K, V]`` state ``S``. Token ``t`` decays it by
``exp(g_t)`` (``g_t <= 0``), corrects what it predicts for the token's key, and reads it:

    S'  = exp(g_t) * S
    u_t = beta_t * (v_t - S'^T k_t)          # the delta: what S' got wrong about v_t
    S_t = S' + k_t u_t^T
    o_t = S_t^T (q_t * scale)

``recurrent_gated_delta_rule`` runs that loop token by token (decode). The chunked form
(prefill) solves each chunk of ``C`` tokens at once: with ``gamma`` the cumulative log
decay inside a chunk and ``S`` the state at its start, the deltas satisfy the unit lower
triangular system

    (I + A) U = beta*V - (beta*exp(gamma)*K) S,  A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j (j < i)

after which outputs and the next chunk's state are matrix products. Both forms take
``[B, T, H, D]`` inputs and an optional ``[B, Hv, K, V]`` initial state, do their maths in
float32 and return ``(output [B, T, Hv, V], final state [B, Hv, K, V] float32)``.

Before the rule, q/k/v pass through a short depthwise causal convolution. Its window (the
last ``kernel - 1`` inputs of a sequence) is carried between steps like the recurrent state,
so a decode step convolves with what the prefill saw. Both live in per-request *state slots*
(``mstar.engine.state_pool``); ``StateBatch`` says which slot each sequence of a step uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    set_weight_loader,
)
from mstar.layers.paged_kv import to_device

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, initial_state, scale):
    """fp32, heads-first ``[B, H, T, D]`` tensors (q/k heads repeated up to the value
    heads), the scaled query, and the initial state (zeros when absent)."""
    batch, _, num_k_heads, key_dim = k.shape
    num_v_heads, value_dim = v.shape[-2:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads is not a multiple of {num_k_heads} key heads")
    if num_v_heads != num_k_heads:
        group = num_v_heads // num_k_heads
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    q = q * (key_dim**-0.5 if scale is None else scale)
    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(torch.float32).clone()
    return q, k, v, g, beta, state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (see the module docstring).

    ``q``/``k`` ``[B, T, Hk, K]``, ``v`` ``[B, T, Hv, V]``, ``g`` (log decay) and ``beta``
    ``[B, T, Hv]``; ``scale`` defaults to ``K ** -0.5``.
    """
    dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    out = torch.empty_like(v)
    for t in range(v.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], state)
    return out.transpose(1, 2).to(dtype), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule ``chunk_size`` tokens at a time; same contract as
    ``recurrent_gated_delta_rule``."""
    dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    batch, heads, length, _ = v.shape
    pad = -length % chunk_size
    if pad:  # zero keys/values/beta and no decay: padded tokens change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))

    gamma = g.cumsum(dim=-1)  # log of the decay from the chunk start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    # The deltas are U = U_v - W S: solve (I + A) once for both right-hand sides.
    rhs = torch.cat((v * beta[..., None], k_beta * gamma.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    deltas_v, deltas_s = solved.split((v.shape[-1], k.shape[-1]), dim=-1)

    scores = (q @ k.transpose(-1, -2)) * decay  # intra-chunk reads, decayed
    q_read = q * gamma.exp()[..., None]  # reads of the chunk-start state
    k_write = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes, decayed to the chunk end
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    out = torch.empty_like(v)
    for c in range(chunks):
        deltas = deltas_v[:, :, c] - deltas_s[:, :, c] @ state
        out[:, :, c] = q_read[:, :, c] @ state + scores[:, :, c] @ deltas
        state = state * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ deltas
    out = out.reshape(batch, heads, chunks * chunk_size, -1)[:, :, :length]
    return out.transpose(1, 2).to(dtype), state


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x [B, T, C]`` continuing from ``window [B, W, C]``
    (the previous ``W = kernel - 1`` inputs, zeros for a fresh sequence); ``weight [C, kernel]``.

    Returns the output ``[B, T, C]`` (no activation) and the new window ``[B, W, C]``.
    """
    width = weight.shape[-1] - 1
    full = torch.cat((window.to(x.dtype), x), dim=1)
    y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype)[:, None, :], bias, groups=x.shape[-1])
    return y.transpose(1, 2), full[:, full.shape[1] - width:]


@dataclass(frozen=True)
class StateBatch:
    """Which state slot each sequence of a step reads and writes.

    Sequences with one new token (decodes) run together through the recurrent form;
    each longer one (a prefill, or a prefill chunk) runs alone through the chunked form.
    Built once per step on the host, shared by every recurrent layer.
    """

    single_rows: torch.Tensor  # [D] int64: token row of each one-token sequence
    single_slots: torch.Tensor  # [D] int64: its state slot
    spans: tuple[tuple[int, int, int], ...]  # (first row, end row, slot) of longer sequences

    @classmethod
    def build(cls, query_start_loc: list[int], slots: list[int], device: torch.device | str) -> StateBatch:
        if len(query_start_loc) != len(slots) + 1:
            raise ValueError(f"{len(slots)} slots for {len(query_start_loc) - 1} sequences")
        rows, single_slots, spans = [], [], []
        for start, end, slot in zip(query_start_loc, query_start_loc[1:], slots):
            if end - start == 1:
                rows.append(start)
                single_slots.append(slot)
            elif end > start:
                spans.append((start, end, slot))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int64), device)  # no wait on the device

        return cls(as_tensor(rows), as_tensor(single_slots), tuple(spans))

    @classmethod
    def decodes(cls, slots: torch.Tensor) -> StateBatch:
        """A step of one token per sequence, row ``b`` in slot ``slots[b]`` (a device tensor):
        built on the device, without a host read, so a CUDA graph can record it."""
        return cls(torch.arange(slots.shape[0], device=slots.device), slots, ())


class GatedRMSNorm(nn.Module):
    """RMS norm of each head's output, scaled by ``weight`` and gated by ``silu(gate)``
    (statistics and gate in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The Qwen3.5 linear-attention token mixer (parameter names are the checkpoint's).

    ``in_proj_qkv`` feeds the causal convolution (then SiLU) and is split into q, k
    (``num_k_heads`` heads of ``key_dim``) and v (``num_v_heads`` of ``value_dim``);
    ``in_proj_a`` and ``dt_bias``/``A_log`` give the log decay
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``in_proj_b`` the write strength
    ``beta = sigmoid(b)``, ``in_proj_z`` the output gate.

    Tensor parallelism (``mstar.layers.linear``, under ``use_parallel``) splits it by heads:
    a rank holds whole key heads of q and of k and whole value heads of v (each segment of
    ``in_proj_qkv`` split on its own, so value head ``j`` still meets key head
    ``j // (num_v_heads / num_k_heads)``), the matching conv channels, rows of
    ``in_proj_z``/``in_proj_b``/``in_proj_a`` and entries of ``dt_bias``/``A_log``, and
    ``out_proj`` sums the ranks' partial outputs. Its states hold only its heads. The
    head counts on the module are this rank's; the gated norm (one ``value_dim`` vector
    shared by every head) is replicated.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, key_dim: int,
                 value_dim: int, conv_kernel: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.key_dim, self.value_dim = key_dim, value_dim
        self.in_proj_qkv = MergedColumnParallelLinear(
            hidden_size, [num_k_heads * key_dim, num_k_heads * key_dim, num_v_heads * value_dim], bias=False,
            blocks=[key_dim, key_dim, value_dim])
        self.num_k_heads = self.in_proj_qkv.local_sizes[0] // key_dim  # on this rank
        self.num_v_heads = self.in_proj_qkv.local_sizes[2] // value_dim
        self.conv_channels = sum(self.in_proj_qkv.local_sizes)
        self.in_proj_z = ColumnParallelLinear(hidden_size, num_v_heads * value_dim, bias=False, block=value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, conv_kernel,
                                groups=self.conv_channels, bias=False, padding=conv_kernel - 1)
        # One depthwise filter per channel of in_proj_qkv's output: the same rows, split alike.
        set_weight_loader(self.conv1d.weight, self.in_proj_qkv.weight.weight_loader)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        for param in (self.dt_bias, self.A_log):
            set_weight_loader(param, self.in_proj_b.weight.weight_loader)  # one entry per value head
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = RowParallelLinear(num_v_heads * value_dim, hidden_size, bias=False, block=value_dim)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes of the two states (this rank's heads): the conv window and the
        recurrent state."""
        return {"conv": (self.conv1d.kernel_size[0] - 1, self.conv_channels),
                "recurrent": (self.num_v_heads, self.key_dim, self.value_dim)}

    def forward(self, x: torch.Tensor, batch: StateBatch, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` of a flattened step -> ``[T, hidden]``; reads and updates the
        slots named by ``batch`` in ``conv_state [slots, W, C]`` and
        ``recurrent_state [slots, Hv, K, V]`` (in place)."""
        qkv = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core = x.new_empty(x.shape[0], self.num_v_heads, self.value_dim)
        if batch.single_rows.numel():
            rows, slots = batch.single_rows, batch.single_slots
            core[rows] = self._mix(qkv[rows, None], g[rows, None], beta[rows, None], slots,
                                   conv_state, recurrent_state, recurrent_gated_delta_rule)[:, 0]
        for start, end, slot in batch.spans:
            slots = to_device(torch.tensor([slot], dtype=torch.int64), x.device)
            core[start:end] = self._mix(qkv[None, start:end], g[None, start:end], beta[None, start:end],
                                        slots, conv_state, recurrent_state, chunked_gated_delta_rule)[0]
        z = self.in_proj_z(x).view(-1, self.num_v_heads, self.value_dim)
        return self.out_proj(self.norm(core, z).reshape(x.shape[0], -1))

    def _mix(self, qkv, g, beta, slots, conv_state, recurrent_state, rule) -> torch.Tensor:
        """Convolution and delta rule for sequences ``[B, T, ...]`` in ``slots [B]``."""
        y, window = causal_conv(qkv, conv_state[slots], self.conv1d.weight[:, 0])
        conv_state[slots] = window.to(conv_state.dtype)
        q, k, v = F.silu(y).split(
            (self.num_k_heads * self.key_dim, self.num_k_heads * self.key_dim, self.num_v_heads * self.value_dim),
            dim=-1)
        batch, length = qkv.shape[:2]
        q = l2_normalize(q.float().view(batch, length, self.num_k_heads, self.key_dim))
        k = l2_normalize(k.float().view(batch, length, self.num_k_heads, self.key_dim))
        v = v.reshape(batch, length, self.num_v_heads, self.value_dim)
        out, state = rule(q, k, v, g, beta, recurrent_state[slots])
        recurrent_state[slots] = state.to(recurrent_state.dtype)
        return out.to(qkv.dtype)
