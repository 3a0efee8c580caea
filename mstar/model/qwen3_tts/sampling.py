"""The code predictor's sampling on the device: every row's code of a group drawn at once,
with no host synchronisation, from noise that depends only on the request, the frame and the
group.

The reference's subtalker samples each code from the top 50 logits at temperature 0.9. Here
a row's draw is the exponential race (``argmax_i p_i / e_i`` with ``e_i ~ Exp(1)`` is
distributed as ``Categorical(p)``), taken in the log domain over the temperature-scaled
logits with everything outside the top ``k`` at ``-inf`` (ties at the ``k``-th value kept,
as transformers' ``TopKLogitsWarper`` keeps them). The exponentials come from a
**counter-based** generator: ``e = -log u``, ``u`` a 32-bit hash of (request key, frame,
group, code id) computed with integer tensor ops on the device. So

* a request's codes do not depend on its batch, its row, or what ran before (no generator
  state to carry, nothing to roll back when a step launched ahead is discarded);
* a step is free of host work and syncs and can be captured in a CUDA graph.

The hash is ``lowbias32`` (Chris Wellons' 32-bit integer mix: two multiply / xor-shift
rounds) over int64 tensors that hold values below ``2**32``; its multiplications are split
into 16-bit halves so no product leaves int64's range (no reliance on wrapping overflow).
``(u >> 8 + 0.5) / 2**24`` makes a float32 uniform strictly inside ``(0, 1)``.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # the Weyl step between a row's code ids
SUBTALKER_TOP_K = 50  # the reference's code-predictor sampling
SUBTALKER_TEMPERATURE = 0.9


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` (a Python int or an int64 tensor) and a
    32-bit constant, without any product reaching ``2**63``."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """``lowbias32``: a 32-bit integer hash of ``0 <= x < 2**32`` (int or int64 tensor)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def request_key(seed: int) -> int:
    """A request's 32-bit stream key from its seed (any int: reduced mod ``2**64``)."""
    seed %= 1 << 64
    return mix32((seed & MASK32) ^ mix32(seed >> 32))


def uniforms(keys: torch.Tensor, frames: torch.Tensor, group: int, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float32 uniforms in ``(0, 1)``: row ``b``'s for the request of key
    ``keys[b]`` at frame ``frames[b]`` (int64 ``[B]``, on the device), codebook ``group``."""
    row = mix32(keys ^ mix32(frames & MASK32))
    row = mix32(row ^ mix32(group + 0x10000))
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64) * GOLDEN
    bits = mix32((row[:, None] + ids[None]) & MASK32)
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def draw(logits: torch.Tensor, keys: torch.Tensor, frames: torch.Tensor, group: int, greedy: torch.Tensor,
         top_k: int = SUBTALKER_TOP_K, temperature: float = SUBTALKER_TEMPERATURE) -> torch.Tensor:
    """Each row's code ``[B]`` from ``logits [B, vocab]``: the top ``top_k`` at
    ``temperature`` by the exponential race on the counter noise of (``keys``, ``frames``,
    ``group``), or the argmax where ``greedy [B]`` (bool) is set. On the logits' device, no sync."""
    scores = logits.float()
    vocab = scores.shape[-1]
    kth = scores.topk(min(top_k, vocab), dim=-1).values[:, -1:]
    scaled = (scores / temperature).masked_fill(scores < kth, float("-inf"))
    noise = uniforms(keys, frames, group, vocab).log_().neg_().log_()  # log of Exp(1) draws
    sampled = (scaled - noise).argmax(dim=-1)
    return torch.where(greedy, scores.argmax(dim=-1), sampled)


__all__ = ["draw", "mix32", "request_key", "uniforms"]
