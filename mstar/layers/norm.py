"""Normalisation layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.distributed.collectives import all_reduce
from mstar.distributed.state import current_parallel
from mstar.layers.linear import set_weight_loader


class RMSNorm(nn.Module):
    """Root-mean-square norm as Llama uses it.

    The statistics are computed in float32; the normalised activations are cast back to the
    input dtype before the (learned) per-channel scale is applied.

    ``norm(x, residual)`` first adds the residual stream and returns ``(normed, x + residual)``
    (the pre-norm decoder's "add, then normalise the new residual"). With ``fused_kernels`` set
    (see ``LlamaForCausalLM.use_fused_kernels``) both forms run as one Triton kernel
    (``mstar.layers.triton_fused.add_rmsnorm``, same rounding points); the torch code below
    stays the reference.
    """

    fused_kernels: bool = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernels:
            from mstar.layers.triton_fused import add_rmsnorm

            normed, summed = add_rmsnorm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ChannelLayerNorm(nn.Module):
    """Layer norm over the channels of ``[B, C, T]`` (each time step's channel vector), with the
    affine parameters named ``gamma``/``beta`` as VITS-style checkpoints (Piper, Kokoro) name them."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, -1), (x.shape[1],), self.gamma, self.beta, self.eps)
        return y.transpose(1, -1)


class WideRMSNorm(nn.RMSNorm):
    """RMS norm over the whole width ``dim`` of q or k (all heads), split over TP ranks.

    Each rank holds ``dim / tp`` features (whole heads) and its slice of ``weight``; the mean
    square is the sum of every rank's squares (all-reduced) over ``dim``. On one rank it is
    ``nn.RMSNorm`` itself, so the single-device numerics stay the reference's."""

    def __init__(self, dim: int, eps: float, head_dim: int) -> None:
        tp = current_parallel().tp
        if dim % (head_dim * tp.size):
            raise ValueError(f"cannot split {dim // head_dim} heads evenly over {tp.size} tensor-parallel ranks")
        super().__init__(dim // tp.size, eps=eps)
        self.tp, self.full_dim = tp, dim
        set_weight_loader(self.weight, self._load_shard)

    @torch.no_grad()
    def _load_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if tuple(full.shape) != (self.full_dim,):
            raise ValueError(f"checkpoint tensor has shape {tuple(full.shape)}, the norm has ({self.full_dim},)")
        param.copy_(full.chunk(self.tp.size)[self.tp.rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        x32 = x.float()
        squares = all_reduce(x32.square().sum(-1, keepdim=True), self.tp)
        return (x32 * torch.rsqrt(squares / self.full_dim + self.eps) * self.weight.float()).type_as(x)
